"""The `ebpo` command line (argparse sub-commands).

    ebpo train RECIPE.yaml [key=value ...]   CPT / SFT / RL training, chosen by the recipe's `kind`
    ebpo generate ...                        draft-and-edit decoding (rollout.cli)
    ebpo eval ...                            held-out accuracy of a checkpoint
    ebpo export RUN_DIR OUT_DIR              write a Hugging Face folder
    ebpo plan RECIPE.yaml [key=value ...]    memory per GPU of an RL recipe on a cluster shape
    ebpo serve [--model M] [--port P]        OpenAI-compatible chat completions (ebpo.serve)
    ebpo bench NAME [...]                    benchmarks: decode, likelihood, rewards, kernels, agent, check, gpu

The top-level parser picks the command; each command's own argparse parser, in the module that owns the
feature, parses the rest (so `ebpo <command> --help` is that parser's help and the CLI never grows into a
second copy of the library). Modules are imported only when their command runs: `ebpo --help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> ("module:function", one-line help); the function takes the remaining argv, returns an exit code.
COMMANDS = {
    "train": ("ebpo.cli.train:main", "CPT / SFT / RL training from a YAML recipe with key=value overrides"),
    "generate": ("ebpo.cli.generate:main", "draft-and-edit decoding of prompts (Quality / Speedy / M2T modes); "
                 "--env: multi-turn rollouts"),
    "eval": ("ebpo.cli.eval:main", "held-out accuracy and tokens per forward of a model, per decode preset"),
    "export": ("ebpo.cli.export:main", "write a run's checkpoint as a Hugging Face model folder"),
    "plan": ("ebpo.cli.plan:main", "memory per GPU of an RL recipe on a cluster shape (nothing is run)"),
    "serve": ("ebpo.serve.cli:main", "OpenAI-compatible chat completions on the rollout engine"),
    "bench": (None, "benchmarks that print a table and can write JSON"),
}

BENCHMARKS = {
    "decode": ("ebpo.bench.decode:main", "decoder: batch and KV-cache speed-ups"),
    "likelihood": ("ebpo.bench.likelihood:main", "vectorized block likelihood vs a per-block loop; replay memory"),
    "rewards": ("ebpo.bench.rewards:main", "math answers/s, sandboxed code executions/s, hang overhead"),
    "kernels": ("ebpo.bench.kernels:main", "FP8 GEMM, fused decode step, chunked log-probs (GPU or CPU)"),
    "learner": ("ebpo.bench.learner:main", "EBPO learner tokens/s: token-budget micro-batches, W = 1 vs 2 ranks"),
    "agent": ("ebpo.bench.agent:main", "multi-turn decoding: ready sequences continuing past one waiting on its tool"),
    "check": ("ebpo.bench.check:main", "headline ratios of the benchmarks against committed baselines"),
    "serve": ("ebpo.bench.serve:main", "ebpo serve: requests/s of 16 concurrent clients vs one at a time, or of "
              "mixed settings vs one (--mixed)"),
    "prefix": ("ebpo.bench.prefix:main", "shared prompt prefixes: 512-token prompts x G = 8, sharing off vs on"),
    "partial": ("ebpo.bench.partial:main", "RL step on long-tailed answers: sync, max_staleness=1, + partial rollouts"),
    "gpu": ("ebpo.bench.gpu:main", "the GPU acceptance run (GPU tests, decode vs the HBM floor, FP8, likelihood); "
            "--device cpu: tiny sizes"),
}


def resolve(target: str):
    """The object named by "package.module:name", imported on first use (commands stay lazy)."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _add_commands(parser: argparse.ArgumentParser, table: dict, dest: str) -> dict:
    """One sub-parser per entry of `table`; returns them by name."""
    sub = parser.add_subparsers(dest=dest, metavar="{" + ",".join(table) + "}", required=True)
    # add_help=False: `--help` after a command goes on to that command's own parser.
    return {name: sub.add_parser(name, help=help_text, description=help_text, add_help=False)
            for name, (_, help_text) in table.items()}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: `ebpo {train,generate,eval,export,bench} ...`; `ebpo bench NAME ...`."""
    parser = argparse.ArgumentParser(
        prog="ebpo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="RL post-training (EBPO) for LLaDA2.x block-diffusion language models.",
        epilog="`ebpo COMMAND --help` describes a command; `ebpo train RECIPE.yaml --help` lists the recipe's keys.")
    bench = _add_commands(parser, COMMANDS, "command")["bench"]
    bench.add_argument("-h", "--help", action="help", help="show this help message and exit")
    _add_commands(bench, BENCHMARKS, "benchmark")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `ebpo` with `argv` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "bench":
        return int(resolve(BENCHMARKS[args.benchmark][0])(rest) or 0)
    return int(resolve(COMMANDS[args.command][0])(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
