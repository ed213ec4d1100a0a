"""Pure helpers of the RL step: group filters and the step's reward and rollout metrics.

No Ray, no I/O: `ebpo.rl.step.collect` calls these between the workers (the learner's batch is built by
`ebpo.rl.records.build_learner_batch`).
"""
from __future__ import annotations

import math

import torch

from ebpo.rl.records import RolloutSample


def zero_std_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(num_groups,) bool per unique group id (sorted): True where every reward in the group is equal."""
    out = []
    for g in torch.unique(group_ids):
        s = scores[group_ids == g]
        out.append(bool((s.max() - s.min()).abs() < 1e-12))
    return torch.tensor(out, dtype=torch.bool)


def reward_metrics(scores: torch.Tensor, group_ids: torch.Tensor, per_fn: dict[str, list[float | None]]) -> dict:
    """`reward/mean`, `reward/std`, `reward/<fn>/mean` (skips excluded), `frac_zero_std_groups`."""
    m = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std(unbiased=False)) if scores.numel() > 1 else 0.0,
        "frac_zero_std_groups": float(zero_std_groups(scores, group_ids).double().mean()),
    }
    for name, vals in per_fn.items():
        real = [v for v in vals if v is not None]
        m[f"reward/{name}/mean"] = sum(real) / len(real) if real else math.nan
    return m


def rollout_metrics(samples: list[RolloutSample], max_new_tokens: int, seconds: float) -> dict:
    """`response_length/{mean,max,clip_ratio}`, `decode/{tpf,forwards,edits_per_seq,lev_share}`,
    `perf/rollout_tokens_per_s`.

    clip_ratio: fraction of responses that reached max_new_tokens without producing EOS. lev_share: fraction of
    responses with at least one DELETE / INSERT block (a pre-edit draft in `lev_drafts`): the only rollouts where
    L-EBPO's ratio differs from EBPO's.
    """
    lengths = [len(s.token_ids) for s in samples]
    clipped = [(not s.finished_by_eos) and len(s.token_ids) >= max_new_tokens for s in samples]
    forwards = [s.num_forwards for s in samples]
    n = max(len(samples), 1)
    return {
        "response_length/mean": sum(lengths) / n,
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": sum(clipped) / n,
        "decode/tpf": sum(lengths) / max(sum(forwards), 1),
        "decode/forwards": sum(forwards) / n,
        "decode/edits_per_seq": sum(s.num_edits for s in samples) / n,
        "decode/lev_share": sum(bool(s.lev_drafts) for s in samples) / n,
        "perf/rollout_tokens_per_s": sum(lengths) / max(seconds, 1e-9),
    }


def filter_groups(keep_group: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: samples whose group is kept. keep_group is indexed by sorted unique group id."""
    uniq = torch.unique(group_ids)
    keep_ids = uniq[keep_group]
    return torch.isin(group_ids, keep_ids)


def first_groups(keep_group: torch.Tensor, k: int) -> torch.Tensor:
    """(num_groups,) bool: `keep_group` with only its first `k` True entries left True (k >= 0).

    Dynamic sampling draws extra prompts until enough groups carry a learning signal; the learner then
    takes the first `k` of them, in draw order, so the batch size stays fixed.
    """
    if k < 0:
        raise ValueError(f"first_groups: k must be >= 0, got {k}")
    rank = torch.cumsum(keep_group.long(), 0)
    return keep_group & (rank <= k)
