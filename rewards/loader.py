"""One loader for every reward reference: built-in names, ``package.module:function`` and
``path/to/file.py:function``; plus the signature check and the call adapter."""
from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from rewards.api import SAMPLE_FIELDS, is_batched

BUILTINS = {
    "math": "rewards.math_reward:math_reward",
    "code": "rewards.code_reward:code_reward",
    "format": "rewards.format_reward:format_reward",
    "format_boxed": "rewards.format_reward:format_boxed",
    "format_code": "rewards.format_reward:format_code",
    "decode_cost": "rewards.decode_cost:decode_cost",
    "task_completion": "rewards.trajectory:task_completion",
    "tool_call_validity": "rewards.trajectory:tool_call_validity",
    "turn_format": "rewards.trajectory:turn_format",
    "reasoning_gym": "rewards.reasoning_gym_reward:reasoning_gym_score",
    "verifiers": "rewards.verifiers_reward:verifiers_reward",
}


class RewardLoadError(ValueError):
    """A reward reference that cannot be imported, or a function whose signature does not fit."""


def import_reference(where: str, ref: str):
    """The module part of a `where:name` reference: a Python file (`path/file.py`) or an importable module
    (`package.module`); `ref` names the reference in the RewardLoadError raised on failure. Shared by reward
    and environment references."""
    if where.endswith(".py") or os.sep in where:
        return load_module_file(where, ref)
    try:
        return importlib.import_module(where)
    except Exception as e:
        raise RewardLoadError(f"reward {ref!r}: importing module {where!r} failed: {type(e).__name__}: {e}") from e


def load_module_file(path: str, ref: str):
    """The Python file `path` imported as a module (once per absolute path); `ref` names it in errors
    (RewardLoadError). Shared by reward and environment references of the form `path.py:name`."""
    if not os.path.isfile(path):
        raise RewardLoadError(f"reward {ref!r}: file {path!r} does not exist")
    # Module name from the absolute path so two files called rewards.py do not collide.
    name = "ebpo_user_reward_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardLoadError(f"reward {ref!r}: importing {path!r} failed: {type(e).__name__}: {e}") from e
    return module


def load_reward(ref: str) -> Callable:
    """Return the reward function named by ``ref`` (built-in name, ``module:function`` or
    ``file.py:function``). Raises RewardLoadError with the reason on any failure."""
    if not isinstance(ref, str) or not ref:
        raise RewardLoadError(f"reward reference must be a non-empty string, got {ref!r}")
    target = BUILTINS.get(ref, ref)
    if ":" not in target:
        raise RewardLoadError(
            f"unknown reward {ref!r}: use a built-in ({', '.join(sorted(BUILTINS))}), "
            "'package.module:function' or 'path/to/file.py:function'")
    where, func_name = target.rsplit(":", 1)
    module = import_reference(where, ref)
    fn = getattr(module, func_name, None)
    if fn is None:
        raise RewardLoadError(f"reward {ref!r}: {where!r} has no attribute {func_name!r}")
    if not callable(fn):
        raise RewardLoadError(f"reward {ref!r}: {where}:{func_name} is a {type(fn).__name__}, not a function")
    check_signature(fn, ref)
    return fn


def accepted_names(fn: Callable) -> set[str] | None:
    """Keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (then it gets every field)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def check_signature(fn: Callable, ref: str, extra_kwargs: dict | None = None) -> None:
    """Raise RewardLoadError when ``fn`` cannot be called with sample fields + ``extra_kwargs`` by keyword."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardLoadError(f"reward {ref!r}: cannot read its signature: {e}") from e
    available = set(SAMPLE_FIELDS) | set(extra_kwargs or {})
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise RewardLoadError(f"reward {ref!r}: parameter {p.name!r} is positional-only; rewards are called "
                                  f"by keyword with {', '.join(SAMPLE_FIELDS)}")
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty and p.name not in available:
            raise RewardLoadError(f"reward {ref!r}: required parameter {p.name!r} is neither a sample field "
                                  f"({', '.join(SAMPLE_FIELDS)}) nor one of its kwargs {sorted(extra_kwargs or {})}")
    names = accepted_names(fn)
    if names is not None and extra_kwargs:
        unknown = set(extra_kwargs) - names
        if unknown:
            raise RewardLoadError(f"reward {ref!r}: kwargs {sorted(unknown)} are not parameters of the function")


def call_reward(fn: Callable, fields: dict, kwargs: dict) -> Any:
    """Call ``fn`` with the fields it accepts plus ``kwargs``; awaits coroutine results."""
    names = accepted_names(fn)
    args = {**fields, **kwargs} if names is None else {k: v for k, v in {**fields, **kwargs}.items() if k in names}
    out = fn(**args)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


async def _await(aw):
    return await aw


def call_batched(fn: Callable, samples: list[dict], kwargs: dict) -> list:
    """Call a batched reward with per-field lists; checks the returned length."""
    fields = {k: [s.get(k) for s in samples] for k in SAMPLE_FIELDS}
    out = call_reward(fn, fields, kwargs)
    out = list(out)
    if len(out) != len(samples):
        raise ValueError(f"batched reward returned {len(out)} results for {len(samples)} samples")
    return out


__all__ = ["BUILTINS", "RewardLoadError", "load_reward", "check_signature", "call_reward", "call_batched",
           "is_batched", "accepted_names"]
