"""`ebpo generate`: `rollout.cli`, plus `--env` for multi-turn rollouts against an environment.

    ebpo generate --model DIR --chat --prompt "Compute 482*37." --env calculator --show

The environment is loaded here (`rewards.envs`), not in rollout, which keeps its import floor: rollout
gets a factory and knows environments only by their `reset` / `step` methods.
"""
from __future__ import annotations

import argparse
import json


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--env", default=None, help="multi-turn: a built-in environment, module:name or file.py:name")
    p.add_argument("--env-kwargs", default="{}", help="JSON keyword arguments of the environment factory")
    p.add_argument("--multiturn", default="{}", help="MultiTurnConfig fields as JSON, e.g. '{\"max_turns\": 3}'")
    known, rest = p.parse_known_args(argv)
    from rollout.cli import main as generate_main

    if known.env is None:
        if "-h" in rest or "--help" in rest:
            print("multi-turn options (ebpo.cli.generate): --env REF [--env-kwargs JSON] [--multiturn JSON]\n")
        return generate_main(rest)
    from rewards.envs import make_environment

    kwargs = json.loads(known.env_kwargs)
    make_environment(known.env, kwargs)  # fail early, naming the reference
    return generate_main(rest, env_factory=lambda: make_environment(known.env, kwargs),
                         multiturn=json.loads(known.multiturn))
