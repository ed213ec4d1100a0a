"""`EngineHolder`: the one long-lived rollout engine of a client (a rollout worker, a benchmark).

A rollout worker decodes many calls (RL steps, evaluations, partial-rollout rounds) with the same model. It keeps
one `Engine` for its whole life: a call asks the holder for an engine that fits it (canvas length, slots, the
engine-wide settings: block size, prefix cache, compiled step) and gets the same one back, grown only when a call
needs a longer canvas or more slots. A weight update (`set_version`) records the new version for the blocks that
start afterwards and recomputes cached keys/values under the new weights.
"""
from __future__ import annotations

from .engine import Engine


class EngineHolder:
    """model: the policy (its weights may be swapped in place between calls); version: the weights' version.
    `rebuilds` counts the engines built (1 for a worker whose calls all fit the first)."""

    def __init__(self, model, version: int = 0):
        self.model, self.version = model, int(version)
        self.engine: Engine | None = None
        self.rebuilds = 0

    def get(self, cfg, *, canvas_len: int, max_batch: int, on_step=None, progress: bool = False) -> Engine:
        """The engine for a call decoding with `cfg` (its default settings for this call), at least `canvas_len`
        positions per slot and `max_batch` slots. The only unfinished sequences of earlier calls it may hold are
        those a client keeps in their slots (`Engine.export(keep_slots=True)`, partial rollouts): no forward moves
        them. When the engine must be rebuilt, they are exported from the old one and adopted anew by their client."""
        e = self.engine
        K = cfg.block_size or self.model.config.block_size
        fixed = (K, cfg.use_cache, cfg.compiled_step)
        if e is None or (e.K, e.cfg.use_cache, e.cfg.compiled_step) != fixed or e.T < canvas_len \
                or e.max_batch < max_batch or (cfg.compiled_step and _step_settings(e.cfg) != _step_settings(cfg)):
            grow = e is not None and (e.K, e.cfg.use_cache, e.cfg.compiled_step) == fixed
            if e is not None:
                e.export()  # sequences it held for their client (partial rollouts) leave with their tokens
            e = Engine(self.model, cfg, max_batch=max(max_batch, e.max_batch if grow else 0),
                       canvas_len=max(canvas_len, e.T if grow else 0), version=self.version)
            self.engine, self.rebuilds = e, self.rebuilds + 1
        e.cfg, e.on_step, e.progress = cfg, on_step, progress
        e.forget_finished()
        return e

    def set_version(self, version: int) -> None:
        """New weights were loaded into the model in place."""
        self.version = int(version)
        if self.engine is not None:
            self.engine.set_version(version)


def _step_settings(cfg):
    """What a compiled step is built for: every setting but the per-sequence length and the slot count."""
    return cfg.replace(max_new_tokens=1, max_batch=0)
