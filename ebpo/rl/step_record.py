"""Pieces of one RL step that both rollout paths share (the synchronous `ebpo.rl.step.collect` and partial
rollouts' `ebpo.rl.partial_collect.collect_partial`): timing a phase, the `agent/*` metrics, and the `StepRecord` of
scored rollouts (advantages, metrics, the kept rows).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
from rollout.trajectory import Trajectory, summarize

from ebpo.core.algos import compute_advantages
from ebpo.rl.batch import filter_groups, first_groups, reward_metrics, rollout_metrics, zero_std_groups
from ebpo.rl.records import RolloutSample, StepRecord
from ebpo.rl.run_state import RLRun


@contextmanager
def timed(times: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time (seconds) to times["timing_s/NAME"]."""
    t0 = time.perf_counter()
    yield
    key = f"timing_s/{name}"
    times[key] = times.get(key, 0.0) + time.perf_counter() - t0


def agent_metrics(samples: list[RolloutSample], prefix: str = "") -> dict[str, float]:
    """`agent/*` metrics of the multi-turn samples (`rollout.trajectory.summarize`: turns, tool calls, tool
    errors and latency, share of environment tokens, stop reasons), `prefix` prepended; {} without any."""
    trajs = [Trajectory.from_dict(s.trajectory) for s in samples if s.trajectory is not None]
    return {prefix + k: float(v) for k, v in summarize(trajs).items()}


def build_record(run: RLRun, step: int, rows: list[dict], prompt_ids: list[list[int]], samples: list[RolloutSample],
                 results: list[dict], times: dict[str, float]) -> StepRecord:
    """The StepRecord of rollouts already scored: `samples` (and `prompt_ids`, `results`) are group by group,
    `rollout.group_size` per row of `rows`; advantages, metrics and the kept rows are computed here."""
    cfg, G, P = run.cfg, run.cfg.rollout.group_size, run.cfg.rollout.prompts_per_step
    group_ids = torch.arange(len(rows)).repeat_interleave(G)
    scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    advantages = compute_advantages(scores, group_ids, method=cfg.trainer.advantage,
                                    std_normalize=cfg.trainer.advantage_std)
    metrics = reward_metrics(scores, group_ids, {n: [r["rewards"].get(n) for r in results] for n in run.reward_names})
    metrics["reward/timeouts"] = float(sum(bool(r.get("timeout")) for r in results))
    metrics["reward/errors"] = float(sum(bool(r.get("error")) for r in results))
    max_new = int(cfg.rollout.decode.get("max_new_tokens", 0) or 0) or max(len(s.token_ids) for s in samples)
    if cfg.env.multi_turn:
        max_new = cfg.env.turns.max_total_tokens
    metrics.update(rollout_metrics(samples, max_new, times["timing_s/rollout"]))
    metrics.update(agent_metrics(samples))

    keep = torch.ones(len(samples), dtype=torch.bool)
    if cfg.trainer.filter_zero_std:
        keep = filter_groups(first_groups(~zero_std_groups(scores, group_ids), P), group_ids)
    metrics["train/samples"] = float(keep.sum())
    metrics["train/prompts_drawn"] = float(len(rows))
    return StepRecord(step=step, rows=rows, prompt_ids=prompt_ids, samples=samples, scores=scores,
                      group_ids=group_ids, advantages=advantages, keep=keep, metrics=metrics, times=times,
                      sampler_after=run.sampler.state())
