"""A calculator environment whose tools are slow for some episodes: the slow-tool workload of `ebpo bench partial`.

    env.name=ebpo.bench.slow_tools:slow_calculator
    env.kwargs={max_turns: 3, timeout_s: 2.0, slow_s: 4.0, fast_s: 0.05, slow_share: 0.25}

An episode is slow with probability `slow_share`: every one of its tool calls then takes `slow_s` seconds of wall
time on top of the calculation, otherwise `fast_s` (a stand-in for a tool that is usually quick and sometimes
waits on a build, a network or a queue). Which episodes are slow is decided by a hash of the row's prompt and the
episode's seed, not by a random draw at run time, so every configuration of the bench meets the same slow episodes
for the same (row, seed) whatever order it builds its environments in.
"""
from __future__ import annotations

import hashlib

from rewards.envs.calculator import answer_matches, calc
from rewards.envs.tools import Tool, ToolEnv


def is_slow(prompt: str, seed: int | None, slow_share: float) -> bool:
    """Whether the episode of (`prompt`, `seed`) is a slow one: a uniform draw in [0, 1) from a hash of both,
    compared with `slow_share`."""
    digest = hashlib.sha256(f"{prompt}\0{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < slow_share


class SlowCalculatorEnv(ToolEnv):
    """`calculator` with a per-episode tool latency (module docstring)."""

    def __init__(self, max_turns: int, timeout_s: float, slow_s: float, fast_s: float, slow_share: float):
        super().__init__([Tool(calc, timeout_s=timeout_s)], score=answer_matches, max_turns=max_turns)
        self.slow_s, self.fast_s, self.slow_share = slow_s, fast_s, slow_share

    def reset(self, row: dict, seed: int | None = None) -> str | None:
        slow = is_slow(str(row.get("prompt", "")), seed, self.slow_share)
        self.latency_s = self.slow_s if slow else self.fast_s
        return super().reset(row, seed)


def slow_calculator(max_turns: int = 3, timeout_s: float = 2.0, slow_s: float = 4.0, fast_s: float = 0.05,
                    slow_share: float = 0.25) -> SlowCalculatorEnv:
    """The environment factory (`env.name=ebpo.bench.slow_tools:slow_calculator`); seconds per tool call:
    `slow_s` in a `slow_share` of the episodes, `fast_s` in the others."""
    for key, value in (("slow_s", slow_s), ("fast_s", fast_s)):
        if value < 0:
            raise ValueError(f"env.kwargs.{key}: must be >= 0 seconds, got {value}")
    if not 0.0 <= slow_share <= 1.0:
        raise ValueError(f"env.kwargs.slow_share: must be in [0, 1], got {slow_share}")
    return SlowCalculatorEnv(max_turns, timeout_s, slow_s, fast_s, slow_share)
