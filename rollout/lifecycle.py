"""What happens to a sequence of the rollout engine between forwards: its settings are checked at submission,
a block starts, a block ends (an MBE window, the next block, a paused turn, the end), a slot is given back.
Functions of the engine's state, kept apart from `rollout.engine` so that the scheduler's class stays small; the
runner (`rollout.runner`) does every device-side change.
"""
from __future__ import annotations

from .sequence import DECODING, FINISHED, MBE, WAITING
from .steps import first_eos


def start_block(engine, s, block: int) -> None:
    """`s` starts decoding `block`: its counters restart."""
    s.new_block(block)
    engine.runner.reset_block(s)


def release(engine, s, end: int) -> None:
    """Copy the sequence's canvas [0, end) and trace out of its slot; free the slot for the next queued one."""
    s.canvas, s.trace = engine.runner.copy_out(s, end)
    engine.runner.free(s)
    s.status = FINISHED
    engine.active.remove(s)
    engine.free.append(s.slot)
    engine.free.sort()


def block_ended(engine, s, eos: bool | None = None) -> None:
    """The active block of `s` ended: an MBE window if its settings ask for one and the turn has an earlier
    block of the same weights version, else `after_block` (eos: whether the generated region holds EOS, when the
    runner already knows)."""
    lo = same_version_from(s)
    if s.cfg.mbe_window > 0 and s.block > lo:
        s.mbe_start = max(lo, s.block - s.cfg.mbe_window)
        s.mbe_passes, s.mbe_first_changed, s.status = 0, None, MBE
    else:
        after_block(engine, s, eos)


def same_version_from(s) -> int:
    """The earliest block of the current turn from which every block up to the active one was decoded under the
    active block's version: MBE never rewrites a block of another version (each block's behaviour term must be
    one version's conditional). Without weight changes: the turn's first block."""
    b, v = s.block, s.block_versions.get(s.block)
    while b > s.first_block and s.block_versions.get(b - 1) == v:
        b -= 1
    return b


def after_mbe(engine, s) -> None:
    """The MBE passes of `s` are over: keys/values from the earliest edited block on are stale; then
    `after_block`."""
    if s.mbe_first_changed is not None:
        engine.runner.invalidate(s, s.mbe_first_changed, s.block)
    s.mbe_start, s.status = None, DECODING
    after_block(engine, s)


def after_block(engine, s, eos: bool | None = None) -> None:
    """Next block, a paused turn or the end of the sequence, by the block's content (eos: whether the generated
    region holds EOS, when the runner already knows; single-turn rows only: a turn's rule reads its tokens)."""
    K = engine.K
    end = (s.block + 1) * K
    if s.turn_rule is None:
        if eos is None:
            stop = min(s.prompt_len + s.max_new, end)
            eos = first_eos(engine.runner.read(s, s.prompt_len, stop), engine.eos_ids) is not None
        if (s.cfg.stop_at_eos and eos) or s.block + 1 >= s.num_blocks:
            release(engine, s, s.num_blocks * K)
        else:
            start_block(engine, s, s.block + 1)
        return
    reason, text = s.turn_rule(engine.runner.read(s, s.start, end))
    if reason is None and s.block + 1 >= s.num_blocks:
        reason = "budget"
    if reason is None:
        start_block(engine, s, s.block + 1)
        return
    s.length, s.status, s.pause = end, WAITING, (reason, text)
    engine.paused.append(s)


def settings_for(engine, config):
    """The `DecodeConfig` a sequence decodes with (`config`, or the engine's when None), checked against
    what is fixed per engine: the block size (every row of a forward has the model's blocks), the prefix
    cache and the compiled step (the engine's own choices, which a request cannot change; the compiled step
    also fixes every decoding threshold: it is one graph for one setting). ValueError names the field."""
    if config is None:
        return engine.cfg
    K = config.block_size or engine.model.config.block_size
    if K != engine.K:
        raise ValueError(f"DecodeConfig.block_size: this engine decodes blocks of {engine.K} tokens, got {K}; "
                         f"the block size is fixed per engine")
    for name in ("use_cache", "compiled_step"):
        if getattr(config, name) != getattr(engine.cfg, name):
            raise ValueError(f"DecodeConfig.{name}: this engine runs with {name}={getattr(engine.cfg, name)}, "
                             f"got {getattr(config, name)}; it is fixed per engine")
    if engine.cfg.compiled_step and config.replace(max_new_tokens=engine.cfg.max_new_tokens,
                                                   max_batch=engine.cfg.max_batch) != engine.cfg:
        raise ValueError("DecodeConfig: the compiled step decodes every sequence with the engine's settings; "
                         "only max_new_tokens may differ per sequence (use the eager engine for mixed settings)")
    if config.levenshtein and engine.model_lev_ids is None:
        raise ValueError("DecodeConfig.tau_delete / tau_insert: the model's config has no delete_token_id / "
                         "insert_token_id; Levenshtein editing needs a model trained with them")
    return config
