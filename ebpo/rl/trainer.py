"""`ebpo train recipes/rl_*.yaml key=value ...`: load and check the recipe, pick the loop, train, plot.

    trainer.max_staleness = 0   ebpo.rl.sync_loop.SyncLoop    collect, update, sync, in turn
    trainer.max_staleness > 0   ebpo.rl.async_loop.AsyncLoop  rollouts run up to s weight versions ahead

Both loops are built on the same roles (docs/architecture.md): `ebpo.rl.setup` (start-up, the `RLRun`),
`ebpo.rl.step` (collect / learn / evaluate over typed records), `ebpo.rl.cluster` (the actors),
`ebpo.rl.weights` (weight versions and their transport), `ebpo.rl.checkpoints`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from ebpo.infra.config import load_config
from ebpo.rl.async_loop import AsyncLoop
from ebpo.rl.config import RLConfig
from ebpo.rl.sync_loop import SyncLoop

Loop = Union[SyncLoop, AsyncLoop]


def make_loop(cfg: RLConfig) -> Loop:
    """The loop trainer.max_staleness asks for, started (actors up, a resumed run restored)."""
    return AsyncLoop(cfg) if cfg.trainer.max_staleness > 0 else SyncLoop(cfg)


def run(recipe: str | None, overrides: list[str]) -> Path:
    """Entry point of `ebpo train` for kind rl: load and check the recipe, train, plot, return the run dir."""
    cfg = load_config(RLConfig, recipe, overrides)
    if cfg.trainer.tracking == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    loop = make_loop(cfg)
    try:
        loop.fit()
    finally:
        loop.close()
    return loop.run_dir
