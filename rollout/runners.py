"""The runners an engine can drive, chosen once when it is built (`make_runner`): the eager reference
(`rollout.runner`), the compiled step (`rollout.static_slots`), one rank of a tensor- / expert-parallel model
(`rollout.parallel_runner`). A module of its own so that the runner seam imports none of its implementations.
"""
from __future__ import annotations

from ebpo.model.parallel import ParallelLLaDA2MoeLM

from .parallel_runner import ParallelRunner
from .runner import EagerRunner
from .static_slots import CompiledRunner


def make_runner(model, cfg, *, max_batch: int, canvas_len: int, K: int, mask_id: int, eos_ids: set[int],
                model_lev_ids, share_prefix: bool = True):
    """The runner an engine with `cfg` drives: one rank's tensor- / expert-parallel runner when `model` is a parallel
    model (`ebpo.model.parallel`), else the compiled step's (`cfg.compiled_step`) or the eager one."""
    kw = dict(max_batch=max_batch, canvas_len=canvas_len, K=K, mask_id=mask_id, model_lev_ids=model_lev_ids)
    if isinstance(model, ParallelLLaDA2MoeLM):
        return ParallelRunner(model, cfg, share_prefix=share_prefix, **kw)
    if cfg.compiled_step:
        return CompiledRunner(model, cfg, eos_ids=eos_ids, **kw)
    return EagerRunner(model, cfg, share_prefix=share_prefix, **kw)
