"""Held-out success of a model on a multi-turn (agentic) task: `ebpo eval --env calculator --data ...`.

Each row is decoded with `rollout.multiturn.run_episodes` (as the RL rollout workers decode) against a fresh
environment built by `rewards.envs.make_environment(env, env_kwargs)`; success is the share of trajectories
whose environment reward (`task_completion`) is positive.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class AgentEval:
    """success: share of rows solved; metrics: `rollout.trajectory.summarize` of all trajectories;
    samples: the first few trajectories as plain data (for tables and `--samples`)."""

    success: float
    rows: int
    wall_s: float
    metrics: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)


def evaluate_agent(model, tokenizer, rows: list[dict], env: str = "calculator", env_kwargs: dict | None = None,
                   decode: dict | None = None, multiturn: dict | None = None, batch_size: int = 32,
                   keep_samples: int = 0, temperature: float = 0.0, seed: int = 0) -> AgentEval:
    """Decode every row's prompt (chat template with the environment's tools, `row["prompt"]`) against its own
    environment; greedy unless
    `temperature` > 0 (then sample i uses seed + i). decode / multiturn: `DecodeConfig` / `MultiTurnConfig`
    fields. Returns an `AgentEval`."""
    from rewards.envs import make_environment
    from rollout.config import DecodeConfig
    from rollout.multiturn import MultiTurnConfig, run_episodes
    from rollout.trajectory import summarize

    from ebpo.infra.data import encode_prompt, tool_specs

    cfg = DecodeConfig.preset("quality", **{"mbe_window": 0, **(decode or {}), "temperature": temperature})
    mt = MultiTurnConfig(**(multiturn or {}))
    probe = make_environment(env, env_kwargs)  # its tools go into every prompt, as in RL (docs/rl.md)
    tools = tool_specs(probe)
    if callable(getattr(probe, "close", None)):
        probe.close()
    t0 = time.perf_counter()
    trajs = []
    for lo in range(0, len(rows), batch_size):
        part = rows[lo:lo + batch_size]
        seeds = [seed + lo + i for i in range(len(part))]  # sampling seeds only matter when temperature > 0
        trajs += run_episodes(model, [encode_prompt(tokenizer, r["prompt"], tools=tools) for r in part], part,
                              lambda: make_environment(env, env_kwargs), cfg, mt, tokenizer=tokenizer, seeds=seeds)
    solved = [float(t.env_reward > 0 and not t.failed) for t in trajs]
    samples = [dict(prompt=r["prompt"], answer=r.get("answer"), solved=s, **t.to_dict())
               for r, s, t in list(zip(rows, solved, trajs))[:keep_samples]]
    return AgentEval(success=sum(solved) / max(1, len(solved)), rows=len(rows), wall_s=time.perf_counter() - t0,
                     metrics=summarize(trajs), samples=samples)
