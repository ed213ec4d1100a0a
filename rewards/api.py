"""The reward API: what a reward returns, how a recipe names one, and how results are normalised.

A reward is a plain function with keyword-only arguments, for example::

    def my_reward(*, completion: str, answer: str | None, **_) -> float: ...

It may ask for any of ``prompt``, ``completion``, ``answer``, ``tests``, ``metadata`` (the dataset row's
fields), ``trajectory`` (a multi-turn rollout's turns, tool calls and results; None for single-turn
samples: rewards/trajectory.py) plus the per-reward ``kwargs`` of its :class:`RewardSpec`; it receives
only the names it declares (or all of them when it takes ``**kwargs``). It returns a float, ``None`` (= skip), or a
:class:`RewardResult` with a score and named extras. ``async def`` rewards are awaited. A batched reward
is marked with :func:`batched` and receives lists (``prompt=[...]``, ``completion=[...]``, ...) and
returns a list of the same length.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

# "trajectory": a multi-turn rollout's record (rewards/trajectory.py), None for single-turn samples.
SAMPLE_FIELDS = ("prompt", "completion", "answer", "tests", "metadata", "trajectory")


@dataclasses.dataclass
class RewardResult:
    """Score of one sample. ``score=None`` means skip: the reward could not judge (infrastructure
    failure, unusable gold answer); skipped rewards contribute nothing and the sample is flagged."""

    score: float | None
    extras: dict = dataclasses.field(default_factory=dict)


def skip(reason: str, **extras: Any) -> RewardResult:
    """A "skip" verdict with its reason in ``extras["skip_reason"]``."""
    return RewardResult(None, {"skip_reason": reason, **extras})


@dataclasses.dataclass
class RewardSpec:
    """One reward of a recipe.

    ref: a built-in name ("math", "code", "format_boxed", "format_code", "format"),
        ``package.module:function`` or ``path/to/file.py:function``.
    weight: multiplies the reward's score in the weighted sum.
    kwargs: extra keyword arguments passed to every call (e.g. ``{"test_timeout_s": 2}`` for "code").
    name: the key under ``result["rewards"]`` and in metrics; defaults to the built-in or function name.
    """

    ref: str
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ref, str) or not self.ref.strip():
            raise ValueError(f"RewardSpec.ref must be a non-empty string, got {self.ref!r}")
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(f"RewardSpec.weight for {self.ref!r} must be a finite number, got {self.weight!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"RewardSpec.kwargs for {self.ref!r} must be a dict, got {type(self.kwargs).__name__}")
        if self.name is None:
            self.name = self.ref.rsplit(":", 1)[-1]


def as_spec(obj: Any) -> RewardSpec:
    """Accept a RewardSpec, a ref string, a ``(ref, weight[, kwargs])`` tuple or a dict with the fields."""
    if isinstance(obj, RewardSpec):
        return obj
    if isinstance(obj, str):
        return RewardSpec(obj)
    if isinstance(obj, dict):
        unknown = set(obj) - {"ref", "weight", "kwargs", "name"}
        if unknown or "ref" not in obj:
            raise ValueError(f"reward spec dict needs 'ref' and may have weight/kwargs/name; got keys {sorted(obj)}")
        return RewardSpec(**obj)
    if isinstance(obj, (tuple, list)) and 1 <= len(obj) <= 3:
        return RewardSpec(*obj)
    raise ValueError(f"cannot read a reward spec from {obj!r}: use RewardSpec, 'ref', (ref, weight, kwargs) or a dict")


def batched(fn: Callable) -> Callable:
    """Mark ``fn`` as batched: it gets lists per field and returns a list of scores/results."""
    fn.batched = True
    return fn


def is_batched(fn: Callable) -> bool:
    return bool(getattr(fn, "batched", False))


def normalize(value: Any, where: str) -> tuple[float | None, dict]:
    """Turn a reward's return value into ``(score or None, extras)``; raise TypeError naming ``where``."""
    if isinstance(value, RewardResult):
        score, extras = value.score, dict(value.extras)
    elif isinstance(value, dict) and "score" in value:
        score, extras = value["score"], {k: v for k, v in value.items() if k != "score"}
    else:
        score, extras = value, {}
    if score is None:
        return None, extras
    # bool is an int subclass; numpy scalars expose __float__. Anything else is a user bug.
    if not isinstance(score, (int, float)) and not hasattr(score, "__float__"):
        raise TypeError(f"{where} returned {type(score).__name__}; expected a float, None or RewardResult")
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"{where} returned a non-finite score {score}")
    return score, extras
