"""Load an environment factory by reference, like rewards: `package.module:name` or `path/file.py:name`.

The named object is called with the recipe's `kwargs` to build one environment per trajectory, so it may
be a class (`MyEnv`) or a factory function (`calculator_env`). Built-in names: `calculator`, `code_repair`.
"""
from __future__ import annotations

from typing import Callable

from rewards.loader import RewardLoadError, import_reference

BUILTIN_ENVS = {"calculator": "rewards.envs.calculator:calculator_env",
                "code_repair": "rewards.envs.code_repair:CodeRepairEnv"}


class EnvLoadError(RewardLoadError):
    """An environment reference that cannot be imported or is not callable."""


def load_environment(ref: str) -> Callable:
    """The environment factory named by `ref`; raises EnvLoadError with the reason."""
    if not isinstance(ref, str) or not ref:
        raise EnvLoadError(f"environment reference must be a non-empty string, got {ref!r}")
    target = BUILTIN_ENVS.get(ref, ref)
    if ":" not in target:
        raise EnvLoadError(f"unknown environment {ref!r}: use a built-in ({', '.join(sorted(BUILTIN_ENVS))}), "
                           "'package.module:name' or 'path/to/file.py:name'")
    where, name = target.rsplit(":", 1)
    try:
        module = import_reference(where, ref)
    except RewardLoadError as e:
        raise EnvLoadError(str(e).replace("reward", "environment", 1)) from e
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        raise EnvLoadError(f"environment {ref!r}: {where!r} has no callable {name!r}")
    return obj


def make_environment(ref: str, kwargs: dict | None = None):
    """One environment: `load_environment(ref)(**kwargs)`; checks it has `reset` and `step`."""
    env = load_environment(ref)(**(kwargs or {}))
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise EnvLoadError(f"environment {ref!r} built a {type(env).__name__} without a {method}() method")
    return env
