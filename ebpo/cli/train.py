"""`ebpo train RECIPE.yaml [key=value ...] [--print-config] [--help]`: CPT, SFT or RL by the recipe's `kind`.

    ebpo train recipes/quickstart.yaml                       run it
    ebpo train recipes/quickstart.yaml learner.lr=1e-4       dotted overrides of any documented key
    ebpo train recipes/quickstart.yaml --print-config        the resolved configuration as YAML; runs nothing
    ebpo train recipes/quickstart.yaml --help                every key of this recipe's kind, with its docs
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from ebpo.cli import resolve
from ebpo.infra.config import ConfigError, describe, load_config, to_dict
from ebpo.infra.data import DataError
from rewards.loader import RewardLoadError

# kind -> (config dataclass, entry point taking (recipe, overrides)); imported only when used.
KINDS = {
    "cpt": ("ebpo.sft.config:SFTConfig", "ebpo.sft.trainer:run"),
    "sft": ("ebpo.sft.config:SFTConfig", "ebpo.sft.trainer:run"),
    "rl": ("ebpo.rl.config:RLConfig", "ebpo.rl.trainer:run"),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of `ebpo train`; `--help` is handled by `main` so that it can list the recipe's keys."""
    p = argparse.ArgumentParser(prog="ebpo train", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train (CPT, SFT or RL) from a YAML recipe; its `kind` picks the trainer.",
                                epilog=__doc__.split("\n\n")[1])
    p.add_argument("recipe", nargs="?", help="a YAML recipe (recipes/ holds the shipped ones)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. learner.lr=1e-4")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as YAML and exit")
    p.add_argument("-h", "--help", action="store_true", help="show this help (with a recipe: all of its keys) and exit")
    return p


def recipe_kind(recipe: str, overrides: list[str]) -> str:
    """The recipe's `kind` (a `kind=` override wins); ConfigError if the file or the kind is wrong."""
    if not Path(recipe).exists():
        raise ConfigError(f"recipe {recipe!r} does not exist")
    try:
        data = yaml.safe_load(Path(recipe).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {recipe!r} is not valid YAML: {e}") from None
    kind = next((o.split("=", 1)[1] for o in overrides if o.startswith("kind=")), data.get("kind"))
    if kind not in KINDS:
        raise ConfigError(f"kind: {kind!r} is not allowed; choose one of {sorted(KINDS)}")
    return kind


def describe_keys(config_cls) -> list[str]:
    """Every key of a recipe kind: the config's own `describe_keys` (sections it checks later) or `describe`."""
    return config_cls.describe_keys() if hasattr(config_cls, "describe_keys") else describe(config_cls)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.help or not args.recipe:
            parser.print_help(sys.stdout if args.help else sys.stderr)
            if args.help and args.recipe:
                kind = recipe_kind(args.recipe, args.overrides)
                print(f"\nkeys of a {kind!r} recipe (dotted name (type, default): documentation):\n")
                print("\n".join("  " + line for line in describe_keys(resolve(KINDS[kind][0]))))
            return 0 if args.help else 2
        kind = recipe_kind(args.recipe, args.overrides)
        config_cls, entry = KINDS[kind]
        if args.print_config:
            cfg = load_config(resolve(config_cls), args.recipe, args.overrides)
            resolved = cfg.resolved() if hasattr(cfg, "resolved") else to_dict(cfg)
            sys.stdout.write(yaml.safe_dump(resolved, sort_keys=False))
            return 0
        resolve(entry)(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"ebpo train: configuration error: {e}", file=sys.stderr)
        return 2
    except (DataError, RewardLoadError) as e:  # their messages name the file and line, or the reward
        print(f"ebpo train: {e}", file=sys.stderr)
        return 2
    return 0
