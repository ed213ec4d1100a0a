"""Noise draws of the block-ELBO composite in the exact form of LLaDA's ELBO (`learner.noise: exact_elbo`).

For a block holding m response tokens, draw n masks exactly k of them, chosen uniformly among the
C(m, k) subsets, with k in {1, ..., m}, and weights each masked token by m / k:

    C_n(block) = (m / k_n) * sum_{masked i} log p_theta(x_i | noisy block, clean blocks before it)

With k uniform on {1..m} this is the LLaDA estimator of the ELBO of the block,
E_k E_{|M| = k} [(m / k) sum_{i in M} log p(x_i | x_{-M})], and it equals the continuous-time 1/t ELBO
with t ~ U(0, 1] and Bernoulli(t) masks exactly: for any one subset S of k tokens,
int_0^1 (1/t) t^k (1 - t)^(m - k) dt = (k - 1)! (m - k)! / m! = 1 / (k C(m, k)), so
E_t E_M [(1/t) f(M)] = sum_k (1/k) mean_{|S| = k} f(S) = E_k [(m/k) E_{|M| = k} f(M)].
No truncation (t_min, t_max are not used), no forcing (k >= 1 by construction): the estimator is
unbiased for the plain ELBO (the tests check it by enumerating every subset).

Stratification: the N draws of a (sequence, block) share one offset u ~ U[0, 1) and take
k_n = floor(m (n + u) / N) + 1, so a uniformly chosen draw has k uniform on {1..m} and the N values of k
spread over 1..m (for N >= m every k appears about N/m times). `t` holds k/m, the fraction masked, and
the weight m/k = 1/t, so `NoiseDraws` keeps its meaning: weight = 1/t at masked positions.
"""
from __future__ import annotations

import torch


def exact_elbo_masks(response_mask: torch.Tensor, block_size: int, n_draws: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masked (N, B, L) bool, t (N, B, nb) fp32 = k/m, weight (N, B, L) fp32 = m/k at masked positions).

    response_mask (B, L) bool; blocks are positions [bK, (b+1)K). Blocks without response tokens get
    t = 1 and nothing masked. Randomness comes only from `generator` (on its device).
    """
    if n_draws < 1:
        raise ValueError(f"n_draws: must be >= 1, got {n_draws}")
    dev = generator.device
    resp = response_mask.to(dev).bool()
    B, L = resp.shape
    K = block_size
    nb = (L + K - 1) // K
    pad = nb * K - L
    resp_blk = torch.nn.functional.pad(resp, (0, pad)).view(B, nb, K)  # (B, nb, K)
    m = resp_blk.sum(-1)  # (B, nb) response tokens per block
    u = torch.rand(B, nb, generator=generator, device=dev)
    n = torch.arange(n_draws, device=dev, dtype=torch.float32)[:, None, None]
    k = torch.floor(m[None] * (n + u[None]) / n_draws).long() + 1  # (N, B, nb), in 1..m where m >= 1
    k = torch.minimum(k, m[None].clamp(min=1))
    # A uniform k-subset of the block's response tokens: the k response positions with the largest keys.
    keys = torch.rand(n_draws, B, nb, K, generator=generator, device=dev).masked_fill(~resp_blk[None], -1.0)
    rank = keys.argsort(-1, descending=True).argsort(-1)  # 0 = largest key
    masked = (rank < k[..., None]) & resp_blk[None]
    t = torch.where(m[None] > 0, k.float() / m[None].clamp(min=1).float(), torch.ones((), device=dev))
    inv_t = m[None].float() / k.float()  # m / k, computed directly (not as 1 / (k/m)) so it is exact
    weight = torch.where(masked, inv_t[..., None], torch.zeros((), device=dev))
    masked = masked.view(n_draws, B, nb * K)[..., :L]
    weight = weight.view(n_draws, B, nb * K)[..., :L]
    return masked, t, weight
