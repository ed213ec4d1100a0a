"""Triton kernel for `kernels.decode.candidates`: one program per position, one pass over the vocabulary.

Online (streaming) max / log-sum-exp / argmax over chunks of BLOCK_V logits, so the softmax never exists.
Sampling adds Gumbel noise -log(-log(u)) in fp32 with u = tl.rand(seed_b, k * V + v) (Philox): the noise of
row b depends only on its seed and the position, not on other rows.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton


@triton.jit
def _candidates_kernel(X, SUP, SEEDS, TOK, PROB, V, K, stride_row, temperature, penalty,
                       SAMPLE: tl.constexpr, HAS_SUP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    b = row // K
    kpos = row % K
    ar = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    if HAS_SUP:
        sup = tl.load(SUP + row)
    if SAMPLE:
        seed = tl.load(SEEDS + b)
    m = tl.full((), neg_inf, tl.float32)        # running max of the (tempered) logits
    s = tl.full((), 0.0, tl.float32)            # running sum of exp(x - m)
    best_key = tl.full((), neg_inf, tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    best_val = tl.full((), neg_inf, tl.float32)  # tempered logit of the current best token
    for start in range(0, V, BLOCK_V):
        offs = start + ar
        mask = offs < V
        x = tl.load(X + row * stride_row + offs, mask=mask, other=neg_inf).to(tl.float32)
        if HAS_SUP:
            x = tl.where(offs == sup, x - penalty, x)
        if SAMPLE:
            x = tl.math.div_rn(x, temperature)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        safe_m = tl.where(new_m == neg_inf, 0.0, new_m)  # all -inf so far: avoid (-inf) - (-inf)
        s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), axis=0)
        m = new_m
        if SAMPLE:
            u = tl.rand(seed, (kpos * V + offs).to(tl.int32))
            u = tl.maximum(u, 1.1754943508222875e-38)
            key = x - tl.log(-tl.log(u))
        else:
            key = x
        key = tl.where(mask, key, neg_inf)
        ck = tl.max(key, axis=0)
        ci = tl.argmax(key, axis=0)  # first index among ties, like torch.argmax
        cv = tl.max(tl.where(ar == ci, x, neg_inf), axis=0)
        upd = ck > best_key  # strict: earlier chunks win ties
        best_key = tl.where(upd, ck, best_key)
        best_idx = tl.where(upd, (start + ci).to(tl.int64), best_idx)
        best_val = tl.where(upd, cv, best_val)
    prob = tl.exp(best_val - m) / s
    tl.store(TOK + row, best_idx)
    tl.store(PROB + row, prob)


def candidates(x: torch.Tensor, temperature: float, seeds: torch.Tensor | None, suppress: torch.Tensor | None,
               penalty: float, block_v: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, K, V) logits; seeds (B,) int64 (sampling) or None (greedy) -> tok (B, K) long, prob (B, K) fp32."""
    B, K, V = x.shape
    x2 = x.reshape(B * K, V)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    tok = torch.empty(B * K, dtype=torch.int64, device=x.device)
    prob = torch.empty(B * K, dtype=torch.float32, device=x.device)
    if B * K == 0:
        return tok.view(B, K), prob.view(B, K)
    sample = temperature > 0
    has_sup = suppress is not None and penalty != 0.0
    sup = suppress.reshape(-1).to(device=x.device, dtype=torch.int64).contiguous() if has_sup else tok
    seeds_t = seeds.to(device=x.device, dtype=torch.int64) if sample else tok
    block_v = min(block_v, triton.next_power_of_2(V))
    _candidates_kernel[(B * K,)](x2, sup, seeds_t, tok, prob, V, K, x2.stride(0),
                                 float(temperature) if sample else 1.0, float(penalty),
                                 SAMPLE=sample, HAS_SUP=has_sup, BLOCK_V=block_v, num_warps=8)
    return tok.view(B, K), prob.view(B, K)
