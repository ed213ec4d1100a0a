"""`ebpo export RUN_DIR OUT_DIR [--step N] [--dtype bf16|fp32]`: write a Hugging Face model folder.

Takes the run's latest checkpoint (or step N), loads the policy weights it holds and writes
`save_pretrained` output (released LLaDA2 weight names) plus the tokenizer, loadable with
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` once `import ebpo.model` has registered the classes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder of `run_dir` (latest, or step N)."""
    root = run_dir / "checkpoints"
    if step is not None:
        path = root / f"step_{step}"
    elif (root / "latest").exists():
        path = root / (root / "latest").read_text().strip()
    else:
        raise FileNotFoundError(f"{run_dir}: no checkpoints/latest; is this a run directory?")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return path


def model_folder(checkpoint: Path) -> Path:
    """The Hugging Face folder inside a checkpoint (`model/`, or the checkpoint itself)."""
    for candidate in (checkpoint / "model", checkpoint):
        if (candidate / "config.json").exists():
            return candidate
    raise FileNotFoundError(f"{checkpoint} holds no model folder (config.json)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ebpo export", description=__doc__.splitlines()[0],
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("run_dir", type=Path, help="a run directory (its checkpoints/ holds step_N folders)")
    parser.add_argument("out_dir", type=Path, help="the Hugging Face folder to write (created if missing)")
    parser.add_argument("--step", type=int, default=None,
                        help="export checkpoint step_N instead of the latest one (default: latest)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32",
                        help="dtype of the written weights (default: %(default)s)")
    args = parser.parse_args(argv)
    from ebpo.model.loading import load_model, load_model_tokenizer

    try:
        src = model_folder(find_checkpoint(args.run_dir, args.step))
    except FileNotFoundError as e:
        print(f"ebpo export: {e}", file=sys.stderr)
        return 2
    model = load_model(str(src), dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    load_model_tokenizer(str(src)).save_pretrained(str(args.out_dir))
    print(f"exported {src} -> {args.out_dir}")
    return 0
