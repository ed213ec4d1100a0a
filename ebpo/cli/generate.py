"""`ebpo generate`: `rollout.cli`, plus `--env` for multi-turn rollouts against an environment.

    ebpo generate --model DIR --chat --prompt "Compute 482*37." --env calculator --show

The environment is loaded here (`rewards.envs`), not in rollout, which keeps its import floor: rollout
gets a factory and knows environments only by their `reset` / `step` methods.
"""
from __future__ import annotations

import argparse
import json
import sys


def env_options() -> argparse.ArgumentParser:
    """The multi-turn options, a parent parser (no -h of its own) that `rollout.cli` lists in its --help."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("multi-turn (agent) rollouts", "Each prompt becomes a trajectory against its own "
                             "environment: the model's turns, tool calls and the tool results (docs/rl.md, "
                             "Agentic RL). Use with --chat.")
    g.add_argument("--env", default=None, metavar="REF",
                   help="the environment: a built-in (calculator), package.module:name or path/to/file.py:name; "
                        "called with --env-kwargs to build one environment per prompt")
    g.add_argument("--env-kwargs", default="{}", metavar="JSON",
                   help="keyword arguments of the environment factory as a JSON object, e.g. "
                        "'{\"max_turns\": 3, \"timeout_s\": 2.0}' (default: {})")
    g.add_argument("--multiturn", default="{}", metavar="JSON",
                   help="rollout.multiturn.MultiTurnConfig fields as a JSON object: max_turns, max_turn_tokens, "
                        "max_total_tokens, step_timeout_s, ..., e.g. '{\"max_turns\": 3, \"max_total_tokens\": 320}' "
                        "(default: the MultiTurnConfig defaults)")
    return p


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def main(argv: list[str]) -> int:
    parent = env_options()
    known, rest = parent.parse_known_args(argv)
    from rollout.cli import main as generate_main

    if known.env is None:
        return generate_main(rest, parents=(parent,))
    from rewards.envs import make_environment

    try:
        kwargs = _json_object(known.env_kwargs, "--env-kwargs")
        multiturn = _json_object(known.multiturn, "--multiturn")
    except ValueError as e:
        print(f"ebpo generate: {e}", file=sys.stderr)
        return 2
    make_environment(known.env, kwargs)  # fail early, naming the reference
    return generate_main(rest, env_factory=lambda: make_environment(known.env, kwargs), multiturn=multiturn,
                         parents=(parent,))
