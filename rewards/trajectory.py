"""Reward terms over whole multi-turn trajectories (turns, tool calls, results), added with weights.

A reward that declares a ``trajectory`` parameter receives the rollout's record as plain data
(`rollout.trajectory.Trajectory.to_dict()`): ``{"turns": [{"text", "finished_by", "tool_calls": [{"name",
"arguments", "ok", "error", "timeout", "invalid", "latency_s", "result"}], "observation", "reward", "done",
"error", ...}], "stop", "failed", "env_reward", ...}``. Single-turn samples carry ``trajectory=None``, so
the terms below skip them, and single-turn rewards, which do not declare it, are called exactly as before.
For a multi-turn sample ``completion`` is the final turn's text, so ``math`` or ``format_boxed`` judge the
final answer unchanged.

Built-ins (names in `rewards.loader.BUILTINS`), each in [0, 1]; a recipe weights them like any reward::

    rewards: [{ref: task_completion, weight: 1.0}, {ref: tool_call_validity, weight: 0.2},
              {ref: turn_format, weight: 0.1}]
"""
from __future__ import annotations

from rewards.api import RewardResult, skip


def _calls(trajectory: dict) -> list[dict]:
    return [c for t in trajectory.get("turns") or [] for c in (t.get("tool_calls") or [])]


def task_completion(*, trajectory: dict | None = None, **_) -> RewardResult:
    """The environment's verdict: the sum of its step rewards (`env_reward`), 0 for a failed trajectory."""
    if trajectory is None:
        return skip("not a multi-turn sample")
    score = 0.0 if trajectory.get("failed") else float(trajectory.get("env_reward") or 0.0)
    return RewardResult(score, {"stop": trajectory.get("stop")})


def tool_call_validity(*, trajectory: dict | None = None, **_) -> RewardResult:
    """Share of the trajectory's tool calls that were well formed (known tool, arguments fitting its schema)
    and ran without error or timeout; 0 when it made no call (on tasks where calls are optional, weight
    it low)."""
    if trajectory is None:
        return skip("not a multi-turn sample")
    calls = _calls(trajectory)
    ok = sum(1 for c in calls if c.get("ok") and not c.get("invalid"))
    return RewardResult(ok / len(calls) if calls else 0.0,
                        {"tool_calls": len(calls), "invalid": sum(1 for c in calls if c.get("invalid"))})


def turn_format(*, trajectory: dict | None = None, **_) -> RewardResult:
    """Share of the turns that ended cleanly (EOS or a closed tool call, not the token budget), times 1 if
    the environment ended the trajectory (stop "done") and 0 if a limit or a failure did."""
    if trajectory is None:
        return skip("not a multi-turn sample")
    turns = trajectory.get("turns") or []
    if not turns or trajectory.get("stop") != "done":
        return RewardResult(0.0, {"stop": trajectory.get("stop")})
    clean = sum(1 for t in turns if t.get("finished_by") in ("eos", "tool_call"))
    return RewardResult(clean / len(turns), {"stop": "done"})
