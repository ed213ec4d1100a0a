"""Fused decode step: each position's candidate token and its probability from the active block's logits.

`candidates(logits (B, K, V), ...)` implements step 1 of draft-and-edit decoding (docs/background.md section 3):
  - temperature == 0: tok = argmax(logits), prob = softmax(logits)[tok];
  - temperature > 0:  tok ~ softmax(filter(logits) / T) by Gumbel-max with fp32 noise (never bf16), row b
    drawing its noise from generators[b] only, and prob = that filtered, tempered probability of tok;
  - suppress/penalty: before anything else, subtract `penalty` from the logit of token suppress[b, k] at
    position (b, k) (SGLang's anti-repetition penalty; -1 = none).

Torch path: exact, a few passes over V (logsumexp, never an explicit softmax tensor). Triton path (CUDA):
one pass over the vocabulary per position with an online max / log-sum-exp / argmax, noise from Triton's
counter-based Philox `tl.rand` seeded by one `torch.randint` draw from each generator. The Triton samples
therefore differ draw-for-draw from the torch path, but are equally reproducible for a given generator
state and independent of batch neighbours. Top-k / top-p filtering (which needs a sort) runs in torch
before the kernel.
"""
from __future__ import annotations

import torch

from ._triton import use_triton


def apply_penalty(logits: torch.Tensor, suppress: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """fp32 copy of logits (B, K, V) with `penalty` subtracted at token suppress[b, k] (entries < 0: none)."""
    x = logits.float()
    if suppress is None or penalty == 0.0:
        return x
    if suppress.shape != logits.shape[:2]:
        raise ValueError(f"suppress must have shape (B, K) = {tuple(logits.shape[:2])}, got {tuple(suppress.shape)}")
    x = x.clone() if x.data_ptr() == logits.data_ptr() else x
    valid = (suppress >= 0).to(x.dtype)
    x.scatter_add_(-1, suppress.clamp_min(0).long()[..., None], (-penalty * valid)[..., None])
    return x


def filter_logits(x: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of fp32 logits (..., V): removed entries become -inf.

    top_p keeps the smallest set of most likely tokens whose mass reaches top_p (the most likely token is
    always kept); ties at the k-th value are all kept.
    """
    V = x.shape[-1]
    if top_k and 0 < top_k < V:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=True)
        p = srt.softmax(-1)
        drop_sorted = (p.cumsum(-1) - p) >= top_p  # mass strictly before this token already reaches top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _check(logits, temperature, top_k, top_p, generators):
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, K, V), got shape {tuple(logits.shape)}")
    check_sampling(logits.shape[0], temperature, top_k, top_p, generators)


def check_sampling(rows: int, temperature: float, top_k: int, top_p: float, generators) -> None:
    """Refuse sampling settings out of range (temperature >= 0, top_p in (0, 1], top_k >= 0) and a generator list
    that is not one per row, with a ValueError naming the setting."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if generators is not None and len(generators) != rows:
        raise ValueError(f"generators: need one per batch row ({rows}), got {len(generators)}")


def gumbel_noise(shape, g: torch.Generator | None, device) -> torch.Tensor:
    """Standard Gumbel noise in fp32 from generator g (drawn on g's device, then moved)."""
    gdev = g.device if g is not None else device
    u = torch.rand(shape, generator=g, device=gdev, dtype=torch.float32).to(device)
    # u is in [0, 1): the floor keeps -log(u) finite; u -> 0 gives a very negative key, never selected
    return -torch.log(-torch.log(u.clamp_min_(torch.finfo(torch.float32).tiny)))


def candidates_torch(logits, temperature=0.0, top_k=0, top_p=1.0, generators=None, suppress=None, penalty=0.0):
    """Exact torch implementation of `candidates` (see module docstring)."""
    x = apply_penalty(logits, suppress, penalty)
    if temperature == 0.0:
        tok = x.argmax(-1)
    else:
        x = filter_logits(x / temperature, top_k, top_p)
        B = x.shape[0]
        gens = generators if generators is not None else [None] * B
        tok = torch.stack([(x[b] + gumbel_noise(x.shape[1:], gens[b], x.device)).argmax(-1) for b in range(B)])
    prob = (x.gather(-1, tok[..., None]).squeeze(-1) - torch.logsumexp(x, -1)).exp()
    return tok, prob


def candidates(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generators: list[torch.Generator] | None = None, suppress: torch.Tensor | None = None,
               penalty: float = 0.0, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token and its probability per position.

    logits (B, K, V) any float dtype; generators: one per row b (None = torch's default generator);
    suppress (B, K) long or None. Returns tok (B, K) long and prob (B, K) fp32.
    backend: "auto" (Triton for CUDA tensors when available) | "torch" | "triton".
    """
    _check(logits, temperature, top_k, top_p, generators)
    if not use_triton(backend, logits):
        return candidates_torch(logits, temperature, top_k, top_p, generators, suppress, penalty)
    from . import decode_triton

    B = logits.shape[0]
    if temperature > 0 and (top_k or top_p < 1.0):
        # filtering needs a sort: do it (and penalty, temperature) in torch, then sample at T = 1
        x = filter_logits(apply_penalty(logits, suppress, penalty) / temperature, top_k, top_p)
        suppress, penalty, temperature_k = None, 0.0, 1.0
    else:
        x, temperature_k = logits, temperature
    seeds = None
    if temperature_k > 0:
        gens = generators if generators is not None else [None] * B
        seeds = torch.cat([torch.randint(0, 2 ** 31 - 1, (1,), generator=g,
                                         device=g.device if g is not None else "cpu") .cpu() for g in gens])
    return decode_triton.candidates(x, temperature_k, seeds, suppress, penalty)
