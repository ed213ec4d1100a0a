"""The environment interface of multi-turn (agentic) rollouts, in the spirit of Gymnasium and OpenEnv.

An environment is an object with two methods::

    obs = env.reset(row, seed)                # row: the dataset row (prompt, answer, ...); obs: extra
                                              # context after the prompt, or None
    obs, reward, done, info = env.step(turn)  # turn: the model's turn as text (ids in info of the call)

`step` returns a `StepResult`, which unpacks as the 4-tuple above. `observation` is the text the
environment adds to the context (a tool's answer); the rollout wraps it in the chat template's tool
turn (`ebpo.core.turns.OBSERVATION_TEMPLATE`) and tokenises only that. `reward` is the environment's own
reward for the step (summed over the trajectory as the `env` reward term, `rewards.trajectory`); `done`
ends the trajectory; `info` is free-form (tool calls, errors, latencies: `rewards.envs.tools` fills
`info["tool_calls"]`); an environment that owns its tokenisation (the agent gateway, `ebpo/serve/gateway.py`)
puts the observation's token ids in `info["observation_ids"]`, and the rollout appends them as given. One
environment object serves one trajectory at a time; the rollout builds one per
trajectory from a factory (`rewards.envs.loader.load_environment`).

Like rewards, environments import nothing of ebpo but this package, so a user's environment file needs
only `rewards` (docs/rl.md, "Environments").
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class StepResult:
    """What one `Environment.step` returns; iterates as (observation, reward, done, info)."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)

    def __iter__(self):
        return iter((self.observation, self.reward, self.done, self.info))


class Environment:
    """Base class of multi-turn environments (subclassing is optional: any object with `reset` and
    `step` of these signatures works).

    max_turns: the most model turns this environment allows (None: the rollout's `max_turns` decides).
    """

    max_turns: int | None = None

    def reset(self, row: dict, seed: int | None = None) -> str | None:
        """Start a trajectory for dataset `row`; returns extra context after the prompt, or None."""
        self.row = row
        return None

    def step(self, turn: str) -> StepResult:
        """Take the model's turn (text); return the observation, the reward, done and info."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds (processes, files); called once per trajectory."""


def as_step_result(value: Any) -> StepResult:
    """A `StepResult` from what `step` returned: a StepResult, a 4-tuple or a dict with those keys.

    Raises TypeError for anything else (the rollout turns that into a failed trajectory)."""
    if isinstance(value, StepResult):
        out = value
    elif isinstance(value, (tuple, list)) and len(value) == 4:
        out = StepResult(*value)
    elif isinstance(value, dict) and {"observation", "done"} <= set(value):
        out = StepResult(value.get("observation"), value.get("reward", 0.0), value["done"], value.get("info") or {})
    else:
        raise TypeError(f"environment step returned {type(value).__name__}; expected StepResult or a 4-tuple")
    if out.observation is not None and not isinstance(out.observation, str):
        raise TypeError(f"environment observation must be str or None, got {type(out.observation).__name__}")
    out.reward = float(out.reward or 0.0)
    out.done = bool(out.done)
    if not isinstance(out.info, dict):
        raise TypeError(f"environment info must be a dict, got {type(out.info).__name__}")
    return out
