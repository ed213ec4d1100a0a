"""The `ebpo` command line.

Sub-commands are thin: each one parses its own arguments in the module that owns the feature, so the
CLI never grows into a second copy of the library.

    ebpo train RECIPE.yaml [key=value ...]   CPT / SFT / RL training, chosen by the recipe's `kind`
    ebpo generate ...                        draft-and-edit decoding (rollout.cli)
    ebpo eval ...                            held-out accuracy of a checkpoint
    ebpo export RUN_DIR OUT_DIR              write a Hugging Face folder
    ebpo bench NAME [...]                    benchmarks: decode, likelihood, rewards, kernels
"""
from __future__ import annotations

import importlib
import sys

# sub-command -> "module:function"; the function takes the remaining argv and returns an exit code.
COMMANDS = {
    "train": "ebpo.train_cli:main",
    "generate": "rollout.cli:main",
    "eval": "ebpo.eval_cli:main",
    "export": "ebpo.export_cli:main",
    "bench": None,  # dispatched on the benchmark name below
}

BENCHMARKS = {
    "decode": "ebpo.bench.decode:main",
    "likelihood": "ebpo.bench.likelihood:main",
    "rewards": "ebpo.bench.rewards:main",
    "kernels": "ebpo.bench.kernels:main",
}


def _resolve(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _usage() -> str:
    return (
        "usage: ebpo {train,generate,eval,export,bench} ...\n"
        "  ebpo train RECIPE.yaml [key=value ...]\n"
        "  ebpo generate --model DIR --prompt TEXT [--mode quality|speed|m2t] [--show]\n"
        "  ebpo eval --model DIR [--mode ...]\n"
        "  ebpo export RUN_DIR OUT_DIR\n"
        f"  ebpo bench {{{','.join(BENCHMARKS)}}} [--json PATH]\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ebpo: unknown command {command!r}; choose one of {sorted(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            got = rest[0] if rest else "nothing"
            print(f"ebpo bench: unknown benchmark {got!r}; choose one of {sorted(BENCHMARKS)}", file=sys.stderr)
            return 2
        return int(_resolve(BENCHMARKS[rest[0]])(rest[1:]) or 0)
    return int(_resolve(COMMANDS[command])(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
