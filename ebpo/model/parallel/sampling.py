"""Decode candidates with the vocabulary split over the tensor-parallel ranks, without gathering rows of logits.

Same semantics as the single-process sampler (`kernels.decode.candidates_torch`, which `rollout.sampling`
matches): penalty first; temperature 0: argmax and its softmax probability; temperature > 0: logits / T, top-k,
then top-p, Gumbel-max with fp32 noise drawn from row b's own generator, and the probability under that
filtered, tempered distribution. Each rank holds logits (B, K, V / tp) of its vocabulary slice.

What travels, and why each step is exact:
  - argmax / Gumbel-max: every rank draws the row's noise for the *whole* vocabulary from the row's generator
    (the same draws, in the same order, as one process) and keeps its slice, so its keys x + g are the
    single-process keys bit for bit. Each rank sends (best key, its index, its logit, its log-sum-exp): the
    winner is the largest key, ties to the lowest index (torch.argmax's rule), so the token is identical.
  - probabilities: the global log-sum-exp is the log-sum-exp of the ranks' ones: the same value up to the
    rounding of a different summation order (a few ulps of fp32).
  - top-k: the k-th largest logit of a row is the k-th largest of the union of the ranks' local top-k values
    (every global top-k entry is in its own rank's top-k): exact; the ranks send k values per row.
  - top-p: the kept set is a prefix of the row sorted by logit, found from the global top-m values (m = top_k
    when set, else 256, grown x4 until the prefix ends inside the m values or the row's finite values run out).
    Only top-m-limited values travel, never the full row unless the nucleus is that large. The masses are
    exp(x - lse) with the global lse: the same tokens are kept unless a cumulative mass lies within rounding
    of top_p, or tokens tie exactly at the boundary value (here all ties are kept; one process keeps the
    ones its sort puts first).
One all-gather for greedy and plain sampling, one more for top-k, one or more for top-p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.decode import check_sampling, gumbel_noise  # the single-process sampler's noise: same draws by construction

TOP_P_FIRST_M = 256


@dataclass(frozen=True)
class VocabShard:
    """Vocabulary slice [start, stop) of this rank out of `size`, and the group holding the other slices."""

    start: int
    stop: int
    size: int
    group: object = None


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    """(P, *t.shape): every rank's t, in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return t[None]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def _check(local, shard: VocabShard, temperature, top_k, top_p, generators):
    if local.dim() != 3 or local.shape[-1] != shard.stop - shard.start:
        raise ValueError(f"local logits must be (B, K, {shard.stop - shard.start}), got {tuple(local.shape)}")
    check_sampling(local.shape[0], temperature, top_k, top_p, generators)


def _penalise(x: torch.Tensor, shard: VocabShard, suppress, penalty: float) -> torch.Tensor:
    """Subtract `penalty` at token suppress[b, k] where this rank holds it (entries < 0: none)."""
    if suppress is None or penalty == 0.0:
        return x
    if suppress.shape != x.shape[:2]:
        raise ValueError(f"suppress must have shape (B, K) = {tuple(x.shape[:2])}, got {tuple(suppress.shape)}")
    local = suppress.long() - shard.start
    here = ((suppress >= 0) & (local >= 0) & (local < x.shape[-1])).to(x.dtype)
    return x.scatter_add(-1, local.clamp(0, x.shape[-1] - 1)[..., None], (-penalty * here)[..., None])


def _global_lse(x: torch.Tensor, group) -> torch.Tensor:
    """(B, K) log-sum-exp of the whole row from every rank's local one."""
    return torch.logsumexp(_gather(torch.logsumexp(x, -1), group), 0)


def _global_top(x: torch.Tensor, m: int, shard: VocabShard) -> torch.Tensor:
    """(B, K, min(m, V)) the row's m largest values, descending (from each rank's local top m)."""
    local = x.topk(min(m, x.shape[-1]), dim=-1).values
    every = _gather(local, shard.group).movedim(0, -2).flatten(-2)  # (B, K, P * m_local)
    return every.topk(min(m, shard.size), dim=-1).values


def _top_k(x: torch.Tensor, shard: VocabShard, top_k: int) -> torch.Tensor:
    if not 0 < top_k < shard.size:
        return x
    kth = _global_top(x, top_k, shard)[..., -1:]
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, shard: VocabShard, top_p: float, top_k: int) -> torch.Tensor:
    """Keep the prefix of the sorted row whose mass strictly before each token is below top_p (module doc)."""
    if top_p >= 1.0:
        return x
    lse = _global_lse(x, shard.group)[..., None]
    m = top_k if 0 < top_k < shard.size else TOP_P_FIRST_M
    while True:
        vals = _global_top(x, m, shard)
        p = (vals - lse).exp()
        drop = (p.cumsum(-1) - p) >= top_p
        drop[..., 0] = False
        # every row decided: its first dropped value lies inside the m values, or nothing finite follows them
        ends = drop.any(-1) | torch.isinf(vals[..., -1]) | (vals.shape[-1] == shard.size)
        if bool(ends.all()):
            break
        m *= 4
    kept = torch.where(drop, torch.full_like(vals, float("inf")), vals)
    threshold = kept.min(-1, keepdim=True).values  # the smallest kept value of each row
    return x.masked_fill(x < threshold, float("-inf"))


def _noise(shape_kv: tuple[int, int], shard: VocabShard, generators, B: int, device) -> torch.Tensor:
    """(B, K, local V) slices of each row's Gumbel noise over the whole vocabulary, drawn from its generator."""
    gens = generators if generators is not None else [None] * B
    return torch.stack([gumbel_noise(shape_kv, gens[b], device)[..., shard.start:shard.stop] for b in range(B)])


def sharded_candidates(local: torch.Tensor, shard: VocabShard, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, generators=None, suppress: torch.Tensor | None = None,
                       penalty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token (B, K) long and its probability (B, K) fp32 from this rank's logits (B, K, local V).

    Every rank of `shard.group` calls it with its slice and the same other arguments (each rank a copy of each
    row's generator in the same state); all ranks return the same result, equal to the single-process
    `candidates` on the full logits (tokens exactly; probabilities to rounding; see the module doc).
    """
    _check(local, shard, temperature, top_k, top_p, generators)
    x = _penalise(local.float(), shard, suppress, penalty)
    if temperature == 0.0:
        keys = x
    else:
        x = _top_p(_top_k(x / temperature, shard, top_k), shard, top_p, top_k)
        keys = x + _noise((x.shape[1], shard.size), shard, generators, x.shape[0], x.device)
    idx = keys.argmax(-1)  # first maximal index, like the single-process argmax
    record = torch.stack([keys.gather(-1, idx[..., None])[..., 0].double(), (idx + shard.start).double(),
                          x.gather(-1, idx[..., None])[..., 0].double(), torch.logsumexp(x, -1).double()], -1)
    every = _gather(record, shard.group)  # (P, B, K, 4)
    key, tok, value, lse = every.unbind(-1)
    best = key.max(0).values
    # the lowest index among the ranks holding the best key (ranks hold increasing index ranges)
    winner = torch.where(key == best, tok, torch.full_like(tok, float("inf"))).argmin(0)
    pick = lambda t: t.gather(0, winner[None])[0]
    tok_out = pick(tok).long()
    prob = (pick(value) - torch.logsumexp(lse, 0)).exp().float()
    return tok_out, prob


def sharded_token_probs(local: torch.Tensor, shard: VocabShard, ids: list[int]) -> torch.Tensor:
    """(B, K, len(ids)) fp32 softmax probabilities of the tokens `ids` under the full rows whose slices (B, K,
    local V) the ranks hold (e.g. the Levenshtein DELETE / INSERT probabilities)."""
    x = local.float()
    vals = torch.full((*x.shape[:2], len(ids)), float("-inf"), dtype=torch.float64, device=x.device)
    for j, t in enumerate(ids):
        if shard.start <= int(t) < shard.stop:
            vals[..., j] = x[..., int(t) - shard.start].double()
    record = torch.cat([vals, torch.logsumexp(x, -1).double()[..., None]], -1)
    every = _gather(record, shard.group)
    lse = torch.logsumexp(every[..., -1], 0)
    return (every[..., :-1].max(0).values - lse[..., None]).exp().float()
