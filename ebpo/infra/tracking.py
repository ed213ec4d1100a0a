"""Metrics tracking for every trainer: JSONL (always), W&B (default, offline without an API key), console.

    tracker = Tracker(run_dir, config_dict, project="ebpo", mode="wandb")   # or mode="none"
    tracker.log({"loss/total": 1.3, "actor/lr": 1e-4}, step=10)
    tracker.log_table("samples", ["prompt", "completion"], [["1+1", "2"]], step=10)
    tracker.finish()

`run_dir/metrics.jsonl` gets one line per `log` call: `{"step": N, "time": unix_s, **metrics}` with
non-finite floats written as null. Tables go to `run_dir/tables/<name>.jsonl`. With mode "wandb" and no
`WANDB_API_KEY`, W&B runs offline (`WANDB_MODE=offline`) with its files under the run directory; a W&B
failure at start-up is reported and the run continues with JSONL only. Pass the `run_id` saved in a
checkpoint to continue the same W&B run after a resume.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def _plain(v):
    """JSON-safe scalar: tensors/numpy to Python, NaN/inf to None."""
    if hasattr(v, "item") and callable(v.item):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Tracker:
    def __init__(self, run_dir: str | Path, config: dict | None = None, project: str = "ebpo",
                 mode: str = "wandb", run_id: str | None = None, name: str | None = None,
                 console: bool = False, console_keys: tuple[str, ...] | None = None):
        """mode "wandb" | "none"; console=True prints one short line per `log` (the `console_keys` only)."""
        if mode not in ("wandb", "none"):
            raise ValueError(f"tracking mode {mode!r} is not allowed; choose 'wandb' or 'none'")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        self.console, self.console_keys = console, console_keys
        self._wandb = None
        self._run_id = run_id
        if mode == "wandb":
            self._start_wandb(config or {}, project, run_id, name or self.run_dir.name)

    def _start_wandb(self, config: dict, project: str, run_id: str | None, name: str) -> None:
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(self.run_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb

            self._wandb = wandb.init(project=project, config=config, dir=str(self.run_dir), id=run_id,
                                     name=name, resume="allow" if run_id else None, reinit="finish_previous")
            self._run_id = self._wandb.id
        except Exception as e:  # tracking must never kill a training run
            print(f"[tracking] W&B disabled: {type(e).__name__}: {e}", file=sys.stderr)
            self._wandb = None

    @property
    def run_id(self) -> str | None:
        """The W&B run id (store it in checkpoints to resume the same W&B run), None without W&B."""
        return self._run_id

    def log(self, metrics: dict, step: int) -> None:
        """Record scalar metrics at `step` (JSONL line, W&B, optional console line)."""
        clean = {k: _plain(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), "time": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=int(step))
        if self.console:
            keys = self.console_keys or tuple(clean)
            shown = " ".join(f"{k}={clean[k]:.4g}" if isinstance(clean[k], float) else f"{k}={clean[k]}"
                             for k in keys if k in clean)
            print(f"step {step}: {shown}", flush=True)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A small table (e.g. sampled completions): `tables/<name>.jsonl` and a W&B Table."""
        tdir = self.run_dir / "tables"
        tdir.mkdir(exist_ok=True)
        with (tdir / f"{name}.jsonl").open("a") as f:
            for r in rows:
                f.write(json.dumps({"step": int(step), **{c: _plain(v) for c, v in zip(columns, r)}}) + "\n")
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=int(step))

    def finish(self) -> None:
        """Flush and close; safe to call twice."""
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
