"""Checkpoints of a run directory, shared by the CPT/SFT and RL trainers.

Layout: `RUN_DIR/checkpoints/step_N/` holding
    model/           `save_pretrained` folder (+ tokenizer files): loadable on its own, `ebpo export` reads it
    optimizer.pt     optimizer state_dict (when given)
    scheduler.pt     LR scheduler state_dict (when given)
    rng.pt           python / numpy / torch RNG states (and the caller's torch.Generator states); with
                     several ranks, rng_rank{R}.pt for every rank R (their noise generators differ)
    state.json       step + the caller's `extra_state` (sampler position, W&B run id, ...)
and `RUN_DIR/checkpoints/latest` a text file naming the newest `step_N`. A checkpoint is written to a
temporary folder and renamed, so a crash never leaves a half-written checkpoint behind `latest`.
Only the newest `keep_last` checkpoints are kept.

With several ranks (torch.distributed initialised) every rank calls `save_checkpoint` together: rank 0
prepares the temporary folder, every rank writes its own part (its DeepSpeed shard through `save_fn`, its
RNG states), rank 0 writes the rest, and the rename happens only after a barrier, so no rank ever writes
into a folder that is being renamed.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    """RNG states of python, numpy, torch (CPU, and CUDA when present) and the named generators."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "generators": {k: g.get_state() for k, g in (generators or {}).items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    """Inverse of `capture_rng` (named generators missing from `state` are left alone)."""
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in (generators or {}).items():
        if k in state.get("generators", {}):
            g.set_state(state["generators"][k])


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def _rng_file(rank: int, world_size: int) -> str:
    return "rng.pt" if world_size == 1 else f"rng_rank{rank}.pt"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, model=None, optimizer=None, scheduler=None,
                    extra_state: dict | None = None, keep_last: int = 2, tokenizer=None,
                    generators: dict[str, torch.Generator] | None = None, save_fn=None) -> Path:
    """Write `checkpoints/step_{step}/` and point `latest` at it; returns its path.

    model: a `PreTrainedModel` (saved with `save_pretrained`, fp32/bf16 as it is) or None;
    save_fn(folder): an optional extra writer (e.g. a DeepSpeed engine's `save_checkpoint`), run on every
    rank. With several ranks, model / optimizer / scheduler / state.json are written by rank 0 only (pass
    what rank 0 holds) and every rank must call this function.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    rank, world = _rank_world()
    root = checkpoint_root(run_dir)
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(world)  # the folder exists before any rank writes into it
    if rank == 0:
        if model is not None:
            model.save_pretrained(str(tmp / "model"))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / "model"))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(capture_rng(generators), tmp / _rng_file(rank, world))
    if save_fn is not None:
        save_fn(tmp)
    _barrier(world)  # every rank's part is on disk before the rename
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps({"step": int(step), "world_size": world, **(extra_state or {})},
                                                   indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / "latest").write_text(final.name)
        steps = sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world)  # nobody goes on (or reads `latest`) before the checkpoint is in place
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder `latest` points at, or None when the run has no checkpoint."""
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist")
    return path


def load_latest(run_dir: str | Path) -> tuple[int, Path, dict]:
    """(step, checkpoint folder, state.json contents) of the newest checkpoint; FileNotFoundError if none."""
    path = latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"resume: no checkpoint in {checkpoint_root(run_dir)} (no `latest` pointer)")
    state = json.loads((path / "state.json").read_text())
    return int(state["step"]), path, state


def load_training_state(path: str | Path, optimizer=None, scheduler=None,
                        generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore optimizer, scheduler and RNG states saved in checkpoint folder `path` (model weights are
    loaded by the caller, e.g. `load_state_dict` of `path/model` or the DeepSpeed engine)."""
    path = Path(path)
    if optimizer is not None and (path / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    if scheduler is not None and (path / "scheduler.pt").exists():
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rank, world = _rank_world()
    rng = path / _rng_file(rank, world)
    if world > 1 and not rng.exists():
        raise FileNotFoundError(f"{path}: no {rng.name}; the checkpoint was written by a different number of ranks "
                                "(resume with the same number of ranks)")
    if rng.exists():
        restore_rng(torch.load(rng, weights_only=False), generators)
