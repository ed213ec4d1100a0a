"""Datasets of task libraries people already use, as rows of ours.

`rg:NAME?size=N&seed=S&key=value...` (a data source in any recipe's `data.train` / `data.eval`) is the
reasoning-gym dataset NAME (`reasoning_gym.create_dataset(NAME, size=N, seed=S, key=value, ...)`; each value
is read as YAML, so `operators=[+,-]` is a list). Every entry becomes a row `{"prompt": question, "answer":
answer, "metadata": metadata}`, which the `reasoning_gym` reward (`rewards/reasoning_gym_reward.py`) scores
with the task's own `score_answer`. Needs the `envs` extra (`pip install -e '.[envs]'`).
"""
from __future__ import annotations

import yaml

PREFIX = "rg:"


class TaskLibraryError(ValueError):
    """A task-library source that cannot be built; the message names the source."""


def parse_rg_source(spec: str) -> tuple[str, dict]:
    """`rg:NAME?size=8&seed=1&k=v` -> ("NAME", {"size": 8, "seed": 1, "k": v}) (values read as YAML)."""
    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    name, _, query = body.partition("?")
    if not name:
        raise TaskLibraryError(f"{spec!r}: no reasoning-gym dataset name (rg:NAME?size=N&seed=S)")
    options = {}
    for item in filter(None, query.split("&")):
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise TaskLibraryError(f"{spec!r}: option {item!r} must look like key=value")
        options[key] = yaml.safe_load(raw)
    for key in ("size", "seed"):
        if key not in options:
            raise TaskLibraryError(f"{spec!r}: give {key}= (rows are generated, so their number and seed are "
                                   "part of the data)")
        if not isinstance(options[key], int) or isinstance(options[key], bool) or options[key] < (key == "size"):
            raise TaskLibraryError(f"{spec!r}: {key} must be an integer >= {int(key == 'size')}, "
                                   f"got {options[key]!r}")
    return name, options


def reasoning_gym_rows(name: str, size: int, seed: int, **config) -> list[dict]:
    """`size` rows of the reasoning-gym dataset `name` generated with `seed` (and the task's `config` fields):
    `{"prompt", "answer", "metadata"}` each, `metadata["source_dataset"] == name`."""
    try:
        import reasoning_gym
    except ImportError:
        raise TaskLibraryError("reasoning-gym is not installed: pip install -e '.[envs]'") from None
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except Exception as e:  # noqa: BLE001 - unknown task or bad config: one line naming it
        raise TaskLibraryError(f"reasoning-gym dataset {name!r} with {config}: {type(e).__name__}: {e}") from None
    return [{"prompt": entry["question"], "answer": str(entry["answer"]), "metadata": dict(entry["metadata"])}
            for entry in dataset]


def load_rg(spec: str) -> list[dict]:
    """The rows of an `rg:` source (module docstring)."""
    name, options = parse_rg_source(spec)
    return reasoning_gym_rows(name, **options)
