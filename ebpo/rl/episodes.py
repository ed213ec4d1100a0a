"""Learner rows of agent episodes: every segment of an episode trained, and per-episode reward normalisation.

An agent episode (`ebpo.serve.gateway`) is one rollout sample, but it may hold several *segments*: a request
that rewrote the history started a new sequence, and the earlier ones are in `trajectory["segments"]`. Each
segment is its own learner row (its tokens never attended another segment's), with the episode's advantage.
`env.episode_norm` decides how much each row weighs:

    none      every row gets the episode's advantage (an episode that forked k times counts k + 1 times)
    segments  each of an episode's k rows gets advantage / k: every episode weighs the same, forked or not
    turns     each row gets advantage / (model turns of the whole episode): every episode weighs the same
              whatever its number of turns (a long episode's tokens do not outweigh a short one's)

Pure Python / torch; the RL step calls `episode_rows` on the kept samples before `build_learner_batch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

EPISODE_NORMS = ("none", "segments", "turns")


@dataclass
class EpisodeRows:
    """Parallel lists, one entry per learner row (the arguments of `build_learner_batch`)."""

    prompt_ids: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    advantages: list = field(default_factory=list)
    group_ids: list = field(default_factory=list)
    tail_ids: list = field(default_factory=list)
    weight_version: list = field(default_factory=list)
    lev_drafts: list = field(default_factory=list)
    turns: list = field(default_factory=list)

    def add(self, prompt, tokens, adv, gid, tail, version, lev, turns) -> None:
        for name, value in zip(("prompt_ids", "token_ids", "advantages", "group_ids", "tail_ids", "weight_version",
                                "lev_drafts", "turns"), (prompt, tokens, adv, gid, tail, version, lev, turns)):
            getattr(self, name).append(value)


def episode_scale(trajectory: dict | None, norm: str) -> float:
    """The factor on an episode's advantage for each of its rows (module docstring)."""
    if norm not in EPISODE_NORMS:
        raise ValueError(f"env.episode_norm: got {norm!r}; allowed: {list(EPISODE_NORMS)}")
    if trajectory is None or norm == "none":
        return 1.0
    segments = trajectory.get("segments") or []
    if norm == "segments":
        return 1.0 / (1 + len(segments))
    turns = len(trajectory.get("turns") or []) + sum(len(s.get("turns") or []) for s in segments)
    return 1.0 / max(1, turns)


def episode_rows(prompt_ids: list[list[int]], samples: list, advantages: torch.Tensor, group_ids: torch.Tensor,
                 norm: str = "none") -> EpisodeRows:
    """Learner rows of kept samples (`RolloutSample`s with their prompt ids, advantages (B,) and group ids
    (B,)): each sample's own row, then one row per earlier segment of an agent episode, every row's advantage
    scaled by `episode_scale`. Single-turn samples pass through unchanged."""
    out = EpisodeRows()
    for p, s, a, g in zip(prompt_ids, samples, advantages.tolist(), group_ids.tolist()):
        t = s.trajectory
        scale = episode_scale(t, norm)
        out.add(p, s.token_ids, a * scale, g, s.tail_ids, s.weights_version, s.lev_drafts,
                None if t is None else (t["generated"], t["segment"]))
        for seg in (t or {}).get("segments") or []:
            P = len(seg["prompt_ids"])
            out.add(list(seg["prompt_ids"]), list(seg["ids"][P:]), a * scale, g, [], s.weights_version,
                    [list(d) for d in seg.get("lev_drafts") or []], (seg["generated"], seg["segment"]))
    return out
