"""Pure helpers of the RL step: turn rollouts into the learner's batch and into metrics.

No Ray, no I/O: the trainer calls these between the workers.
"""
from __future__ import annotations

import math

import torch


def build_learner_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], advantages: torch.Tensor,
                        group_ids: torch.Tensor, pad_id: int, tail_ids: list[list[int]] | None = None) -> dict:
    """Right-padded learner batch.

    prompt_ids[i], response_ids[i]: token ids (the response ends at its first EOS, EOS included, or is
    cut at max_new_tokens). tail_ids[i] (optional): what the sampler's canvas holds after the response up
    to the end of the response's last block (the rest of that block: tokens after the EOS, or past
    max_new_tokens for a cut response). The tail is appended and scored with the response, so the
    learner's sequence is the canvas the sampler really produced, block for block (docs/ebpo.md, "The
    last block"). Without tails, positions after the response are `pad_id` and not scored.
    Returns `input_ids` (B, L) long, `prompt_lens` (B,), `response_lens` (B,) (the response without its
    tail), `response_mask` (B, L) bool marking scored positions (response and tail, never padding),
    `advantages` (B,) fp32, `group_ids` (B,) long.
    """
    B = len(prompt_ids)
    tails = tail_ids if tail_ids is not None else [[] for _ in range(B)]
    if len(tails) != B:
        raise ValueError(f"tail_ids: {len(tails)} tails for {B} responses")
    scored = [list(r) + list(t) for r, t in zip(response_ids, tails)]
    lens = [len(p) + len(r) for p, r in zip(prompt_ids, scored)]
    L = max(lens)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, L, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, scored)):
        input_ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        if r:
            input_ids[i, len(p): len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[i, len(p): len(p) + len(r)] = True
    return {
        "input_ids": input_ids,
        "prompt_lens": torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        "response_lens": torch.tensor([len(r) for r in response_ids], dtype=torch.long),
        "response_mask": response_mask,
        "advantages": advantages.float(),
        "group_ids": group_ids.long(),
    }


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


def rollout_metrics(samples: list[dict], max_new_tokens: int, seconds: float) -> dict:
    """`response_length/{mean,max,clip_ratio}`, `decode/{tpf,forwards,edits_per_seq}`, `perf/rollout_tokens_per_s`.

    clip_ratio: fraction of responses that reached max_new_tokens without producing EOS.
    """
    lengths = [len(s["token_ids"]) for s in samples]
    clipped = [(not s["finished_by_eos"]) and len(s["token_ids"]) >= max_new_tokens for s in samples]
    forwards = [s["num_forwards"] for s in samples]
    n = max(len(samples), 1)
    return {
        "response_length/mean": sum(lengths) / n,
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": sum(clipped) / n,
        "decode/tpf": sum(lengths) / max(sum(forwards), 1),
        "decode/forwards": sum(forwards) / n,
        "decode/edits_per_seq": sum(s["num_edits"] for s in samples) / n,
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
