"""Typed configuration: dataclasses loaded from YAML recipes with dotted `key=value` overrides.

Every config section is a dataclass whose fields carry their documentation in
`field(metadata={"help": ...})` (see `doc`). Loading checks everything at start-up: an unknown key,
a value of the wrong type or a value outside a `Literal[...]` fails with a `ConfigError` that names
the dotted key and what is allowed.

    cfg = load_config(RLConfig, "recipes/quickstart.yaml", ["learner.lr=1e-4", "rollout.mode=speed"])
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from ebpo.core.fields import doc  # noqa: F401 (re-exported: the config sections use it)


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the dotted key."""


def parse_overrides(overrides: list[str]) -> dict:
    """["a.b=1", "c=x"] -> {"a": {"b": 1}, "c": "x"}; values are parsed as YAML scalars/lists."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (dotted keys for sections)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        node = tree
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return tree


def deep_merge(base: dict, update: dict) -> dict:
    """Recursively merge `update` into a copy of `base`. An empty mapping in `update` replaces what `base`
    holds (`env.kwargs={}` clears the recipe's kwargs; a non-empty one merges key by key)."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and v and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def build(cls, data: dict | None, prefix: str = ""):
    """Construct dataclass `cls` from a plain dict, checking keys, types and Literal choices."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"section {prefix!r}" if prefix else "top level"
        raise ConfigError(f"unknown key {prefix + unknown[0]!r} in {where}; allowed keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{prefix}{e}" if prefix and not str(e).startswith(prefix) else str(e)) from None
    return obj


def _coerce(tp, value, key: str):
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        upgrade = getattr(tp, "upgrade_spelling", None)  # a section's deprecated spelling, rewritten with a warning
        if upgrade is not None and not isinstance(value, tp):
            value = upgrade(value, key)
        return value if isinstance(value, tp) else build(tp, value, key + ".")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {args}")
    if tp is Any:
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if value is None:  # `key=null` clears a mapping (e.g. env.kwargs=null)
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-4" as a string
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    """Load dataclass `cls` from a YAML file (or defaults when None) plus dotted overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"recipe {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {e}") from None
    return build(cls, apply_overrides(data, overrides or []))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` with the dotted overrides applied one after another, in order, so that a later override
    builds on an earlier one: `env.kwargs={} env.kwargs.max_turns=3` leaves exactly {max_turns: 3}.
    A mapping merges into the mapping it lands on; `{}` or `null` replaces it (clears it)."""
    for item in overrides:
        data = deep_merge(data, parse_overrides([item]))
    return data


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (for YAML dumps, W&B and checkpoints)."""
    return dataclasses.asdict(cfg)


def save_config(cfg, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls, prefix: str = "") -> list[str]:
    """One line per field: `dotted.key (type, default): help` — the reference for recipes."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines += describe(tp, prefix + f.name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
        lines.append(f"{prefix}{f.name} ({getattr(tp, '__name__', str(tp))}, default {default!r}): "
                     f"{f.metadata.get('help', '')}")
    return lines
