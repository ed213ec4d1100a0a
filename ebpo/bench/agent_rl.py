"""`ebpo bench agent` (RL part): wall time per RL step of an agentic recipe at `trainer.max_staleness` 0 and 1,
on a task whose tools take real wall time, so that the asynchronous loop can hide it behind learning.

Each run is the recipe (default `recipes/quickstart_agent.yaml`) with the calculator's `latency_s` added to
every tool call, no evaluation, no checkpoints, every group trained (`filter_zero_std=false`: the learner
does the same work every step) and one thread pool slot per trajectory (`env.turns.max_workers`), so a
turn's tool calls wait in parallel. The period of a step is measured between the loop's per-step logs
(the first step, which also pays start-up and warm-up, is left out). At s = 0 a step is rollout (decode +
tool waits) + reward + update + weight sync in turn; at s = 1 the producer thread collects step k + 1
while the learner updates on step k, so the period approaches max(rollout, update) instead of their sum.
"""
from __future__ import annotations

import os
import tempfile
import time


def fit_with_step_stamps(loop) -> tuple[list[dict], dict[int, float], list]:
    """Train `loop` (a `make_loop` result) to its end and close it; returns (per-step metrics, step ->
    perf_counter seconds when that step's metrics were logged, the run's version_log)."""
    stamps: dict[int, float] = {}
    log = loop.run.tracker.log

    def stamped(metrics: dict, step: int) -> None:  # the wall clock at the end of every step
        stamps[int(step)] = time.perf_counter()
        log(metrics, step)

    loop.run.tracker.log = stamped
    try:
        history = loop.fit()
    finally:
        loop.close()
    return history, stamps, list(loop.run.version_log)


def rl_step_period(recipe: str, staleness: int, latency_s: float, steps: int, threads: int,
                   extra: list[str] | None = None) -> dict:
    """Run `steps` RL steps of `recipe` at `trainer.max_staleness = staleness` with tools taking `latency_s`;
    returns {"staleness", "period_s" (mean seconds per step after the first), "rollout_s", "update_s",
    "wait_s" (learner waiting on rollouts, async only), "tool_latency_s" (sum per trajectory), "turns"}."""
    from ebpo.infra.config import load_config
    from ebpo.rl.config import RLConfig
    from ebpo.rl.trainer import make_loop

    run_dir = tempfile.mkdtemp(prefix=f"ebpo-bench-agent-rl-s{staleness}-")
    overrides = [f"env.kwargs.latency_s={latency_s}", f"trainer.steps={steps}", "data.eval=null",
                 "trainer.tracking=none", "trainer.progress=false", "trainer.plots=false", "trainer.save_every=0",
                 f"trainer.max_staleness={staleness}", "trainer.filter_zero_std=false", "trainer.dynamic_sampling=0",
                 "env.turns.max_workers=256", f"trainer.run_dir={run_dir}", f"rollout.num_threads={threads}",
                 *(extra or [])]
    cfg = load_config(RLConfig, recipe, overrides)
    os.environ.setdefault("WANDB_MODE", "offline")
    history, stamps, _ = fit_with_step_stamps(make_loop(cfg))
    later = [h for h in history if h["step"] > 1]

    def mean(key: str) -> float:
        return sum(h.get(key, 0.0) for h in later) / max(len(later), 1)

    return {"staleness": staleness, "period_s": (stamps[steps] - stamps[1]) / (steps - 1),
            "rollout_s": mean("timing_s/rollout"), "update_s": mean("timing_s/update"),
            "wait_s": mean("timing_s/wait_rollout"), "tool_latency_s": mean("agent/tool_latency_s"),
            "env_latency_s": mean("agent/env_latency_s"), "turns": mean("agent/turns"),
            "tool_calls": mean("agent/tool_calls")}


def compare(recipe: str, latency_s: float, steps: int, threads: int, extra: list[str] | None = None) -> dict:
    """Both runs (s = 0, then s = 1) and the speed-up of the step period."""
    runs = [rl_step_period(recipe, s, latency_s, steps, threads, extra) for s in (0, 1)]
    return {"recipe": recipe, "latency_s": latency_s, "steps": steps, "runs": runs,
            "speedup": runs[0]["period_s"] / runs[1]["period_s"]}


def table(res: dict):
    from rich.table import Table

    t = Table(title=f"agentic RL step, tools {res['latency_s']:g} s per call ({res['recipe']}, "
                    f"{res['steps']} steps, first left out)")
    for col in ("trainer.max_staleness", "s per step", "rollout s", "update s", "learner waits s",
                "tool calls / traj", "tool s / traj"):
        t.add_column(col)
    for r in res["runs"]:
        t.add_row(str(r["staleness"]), f"{r['period_s']:.2f}", f"{r['rollout_s']:.2f}", f"{r['update_s']:.2f}",
                  f"{r['wait_s']:.2f}" if r["staleness"] else "-", f"{r['tool_calls']:.2f}",
                  f"{r['tool_latency_s']:.2f}")
    return t
