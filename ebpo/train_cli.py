"""`ebpo train RECIPE.yaml [key=value ...]`: dispatch on the recipe's `kind` (cpt, sft or rl)."""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from .config import ConfigError

KINDS = {
    "cpt": "ebpo.sft:run",
    "sft": "ebpo.sft:run",
    "rl": "ebpo.trainer:run",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: ebpo train RECIPE.yaml [key=value ...]   (recipes/ holds the shipped ones)", file=sys.stderr)
        return 2
    recipe, overrides = argv[0], argv[1:]
    try:
        if not Path(recipe).exists():
            raise ConfigError(f"recipe {recipe!r} does not exist")
        data = yaml.safe_load(Path(recipe).read_text()) or {}
        kind = next((o.split("=", 1)[1] for o in overrides if o.startswith("kind=")), data.get("kind"))
        if kind not in KINDS:
            raise ConfigError(f"kind: {kind!r} is not allowed; choose one of {sorted(KINDS)}")
        module, func = KINDS[kind].split(":")
        import importlib

        run = getattr(importlib.import_module(module), func)
        run(recipe, overrides)
    except ConfigError as e:
        print(f"ebpo train: configuration error: {e}", file=sys.stderr)
        return 2
    return 0
