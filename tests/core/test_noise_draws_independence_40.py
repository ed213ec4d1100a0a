"""Independence of the exact-ELBO draws (issue 40): every (row, block) draws its own offset u, hence its own k,
and every draw its own uniform subset. A change that shares one random draw between rows or between draws keeps
every marginal the other tests check (k uniform on 1..m, subsets uniform) and breaks only independence.

Both tests use a fixed seed, so they are deterministic; the bound stated in each is the probability that the
correct code fails it for a seed drawn at random, i.e. how unlucky the fixed seed would have to be."""
import math

import torch

from ebpo.core.noise_draws import exact_elbo_masks


def test_rows_and_blocks_draw_their_own_k():
    """Rule: with one draw, k = floor(m u) + 1 with u ~ U[0, 1) drawn per (row, block), so over B rows of full
    blocks (m = K) the k of a block column are B independent uniforms on 1..K.

    Checked: each of the K values appears in each block column, and the two blocks of a row do not agree on
    every row. False failure for a random seed: union bound over 2 blocks x K values of (1 - 1/K)^B, plus
    K^-B for the rows all agreeing; with B = 256, K = 8: 2 * 8 * (7/8)^256 + 8^-256 < 3e-14.
    A shared draw across rows puts all B rows of a block on one k."""
    B, K = 256, 8
    assert 2 * K * (1 - 1 / K) ** B + K ** -B < 3e-14
    resp = torch.ones(B, 2 * K, dtype=torch.bool)
    masked, t, w = exact_elbo_masks(resp, K, 1, torch.Generator().manual_seed(1234))
    k = (t[0] * K).round().long()  # (B, 2): t = k / m with m = K
    assert torch.equal(k, masked[0].view(B, 2, K).sum(-1))  # t is the fraction masked
    for b in range(2):
        assert set(k[:, b].tolist()) == set(range(1, K + 1)), b
    assert not torch.equal(k[:, 0], k[:, 1])


def test_draws_mask_independent_subsets():
    """Rule: each draw masks a uniform k-subset of the block's response tokens, independently of the other
    draws. With N = 2K draws of a full block, k_n = floor(K (n + u) / N) + 1 = floor((n + u) / 2) + 1, so draws
    2j and 2j+1 share k = j + 1 (checked below); independent uniform subsets of the same size k coincide with
    probability 1 / C(K, k).

    Checked over B rows, for the pair with k = K/2 (C(8, 4) = 70): at most B/2 rows have the two draws mask
    the same subset. Their count is Binomial(B, 1/70) under the rule, so a random seed fails with probability
    P(Bin(64, 1/70) >= 32) <= C(64, 32) * 70^-32 < 1e-40. Draws sharing one set of keys mask the same subset
    in every row (and nested subsets for different k)."""
    B, K = 64, 8
    N = 2 * K
    assert math.comb(B, B // 2) * (1 / math.comb(K, K // 2)) ** (B // 2) < 1e-40
    resp = torch.ones(B, K, dtype=torch.bool)
    masked, t, w = exact_elbo_masks(resp, K, N, torch.Generator().manual_seed(99))
    k = (t[:, :, 0] * K).round().long()  # (N, B)
    want = (torch.arange(N) // 2 + 1)[:, None].expand(N, B)
    assert torch.equal(k, want)
    j = K // 2 - 1  # draws 2j, 2j + 1 have k = K / 2
    same = (masked[2 * j] == masked[2 * j + 1]).all(-1)  # (B,)
    assert int(same.sum()) <= B // 2, int(same.sum())
    # the same for every k in 2..K-2 at once (C(K, k) >= 28, pairs of different k independent): at most half
    # of the 5B pairs coincide; false failure <= C(5B, 5B/2) * 28^-(5B/2) < 2^(5B) * 28^-(5B/2) = 2^-449
    pairs = torch.stack([(masked[2 * (kk - 1)] == masked[2 * (kk - 1) + 1]).all(-1) for kk in range(2, K - 1)])
    assert int(pairs.sum()) <= pairs.numel() // 2
