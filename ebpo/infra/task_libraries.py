"""Datasets of task libraries people already use, as rows of ours.

`rg:NAME?size=N&seed=S&key=value...` (a data source in any recipe's `data.train` / `data.eval`) is the
reasoning-gym dataset NAME (`reasoning_gym.create_dataset(NAME, size=N, seed=S, key=value, ...)`; each value
is read as YAML, so `operators=[+,-]` is a list). Every entry becomes a row `{"prompt": question, "answer":
answer, "metadata": metadata}`, which the `reasoning_gym` reward (`rewards/reasoning_gym_reward.py`) scores
with the task's own `score_answer`.

`vf:REF?split=train&limit=N&key=value...` is the dataset of the verifiers environment REF, built by its own
`load_environment(key=value, ...)` (REF: an installed environment module, as `verifiers.load_environment`
takes it, or a path to a .py file that defines `load_environment`); split `train` (default) or `eval`, the
first `limit` rows (0 = all). Each row is `{"prompt": the last user message, "answer", "metadata":
{"verifiers": {"env", "env_args", "input"}}}`, `input` being the environment's own row (its chat messages
included), which the `verifiers` reward (`rewards/verifiers_reward.py`) scores with the environment's rubric.

Both need the `envs` extra (`pip install -e '.[envs]'`; verifiers on Python 3.11-3.13).
"""
from __future__ import annotations

import yaml

PREFIX = "rg:"
VF_PREFIX = "vf:"


class TaskLibraryError(ValueError):
    """A task-library source that cannot be built; the message names the source."""


def _parse_query(spec: str, prefix: str, what: str) -> tuple[str, dict]:
    body = spec[len(prefix):] if spec.startswith(prefix) else spec
    name, _, query = body.partition("?")
    if not name:
        raise TaskLibraryError(f"{spec!r}: no {what} ({prefix}NAME?key=value&...)")
    options = {}
    for item in filter(None, query.split("&")):
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise TaskLibraryError(f"{spec!r}: option {item!r} must look like key=value")
        options[key] = yaml.safe_load(raw)
    return name, options


def parse_rg_source(spec: str) -> tuple[str, dict]:
    """`rg:NAME?size=8&seed=1&k=v` -> ("NAME", {"size": 8, "seed": 1, "k": v}) (values read as YAML)."""
    name, options = _parse_query(spec, PREFIX, "reasoning-gym dataset name")
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


def _vf_environment(ref: str, env_args: dict):
    """verifiers' `load_environment` convention: `ref` a .py file defining it, else an installed module."""
    try:
        import verifiers
    except ImportError:
        raise TaskLibraryError("verifiers is not installed: pip install -e '.[envs]' (Python 3.11-3.13)") from None
    try:
        if ref.endswith(".py"):
            import importlib.util
            from pathlib import Path

            if not Path(ref).is_file():
                raise FileNotFoundError(f"no file {ref!r}")
            spec = importlib.util.spec_from_file_location("ebpo_vf_env_" + Path(ref).stem, ref)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.load_environment(**env_args)
        return verifiers.load_environment(ref, **env_args)
    except Exception as e:  # noqa: BLE001 - any failure to build it: one line naming the environment
        raise TaskLibraryError(f"verifiers environment {ref!r} with {env_args}: {type(e).__name__}: {e}") from None


def verifiers_rows(ref: str, split: str = "train", limit: int = 0, **env_args) -> list[dict]:
    """Rows of the verifiers environment `ref`'s `split` dataset (module docstring)."""
    if split not in ("train", "eval"):
        raise TaskLibraryError(f"verifiers environment {ref!r}: split must be train or eval, got {split!r}")
    env = _vf_environment(ref, env_args)
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    rows = []
    for i, item in enumerate(dataset):
        if limit and i >= limit:
            break
        item = dict(item)
        messages = item.get("prompt") or []
        user = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        prompt = user[-1] if user and isinstance(user[-1], str) else item.get("question")
        if not isinstance(prompt, str):
            raise TaskLibraryError(f"verifiers environment {ref!r} row {i}: no text user message to prompt with")
        env_input = {k: v for k, v in item.items() if k != "question"}
        rows.append({"prompt": prompt, "answer": str(item.get("answer", "")),
                     "metadata": {"verifiers": {"env": ref, "env_args": env_args, "input": env_input}}})
    return rows


def load_vf(spec: str) -> list[dict]:
    """The rows of a `vf:` source (module docstring)."""
    ref, options = _parse_query(spec, VF_PREFIX, "verifiers environment")
    split, limit = options.pop("split", "train"), options.pop("limit", 0)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise TaskLibraryError(f"{spec!r}: limit must be an integer >= 0, got {limit!r}")
    return verifiers_rows(ref, split, limit, **options)
