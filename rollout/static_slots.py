"""The engine's side of the compiled step (`rollout.compiled`): its fixed-size KV cache, the per-slot inputs it
reads each iteration, and the eager `refill` forwards that give the cache what the step cannot compute itself.

The step recomputes each row's previous block with its active block, so a row decoding block b needs valid
keys/values for blocks [0, b - 1) in its cache slot. They are written block-causally by `refill`:
  - on admission: the prompt's whole blocks;
  - when a turn resumes after its observation: the turn's last block and the observation's blocks;
  - after a Multi-Block Editing pass that changed tokens: the blocks from the earliest changed one on.
"""
from __future__ import annotations

import torch

from ebpo.model.cache import StaticKVCache

from .compiled import StaticDecodeStep, compiled_step, draw_noise


class StaticSlots:
    """The compiled step over an engine's `max_batch` slots (built by the engine when `compiled_step` is on)."""

    def __init__(self, engine):
        model, B, T, K = engine.model, engine.max_batch, engine.T, engine.K
        param = next(model.parameters())
        self.cache = StaticKVCache.for_model(model.config, B, T + K, dtype=param.dtype, device=param.device)
        self.step = compiled_step(StaticDecodeStep(model, engine.cfg, K, T, engine.mask_id, engine.eos_ids,
                                                   self.cache, engine.lev_ids))

    def place(self, engine, s) -> None:
        """A sequence was admitted into slot `s.slot`: its prompt's whole blocks into the cache."""
        self.refill(engine, s, 0)

    def resume(self, engine, s) -> None:
        """A turn resumes after its observation: the last turn's final block onwards into the cache."""
        self.refill(engine, s, s.turns[-1].end // engine.K - 1)

    def refill(self, engine, s, from_block: int, to_block: int | None = None) -> None:
        """Keys/values of blocks [from_block, to_block) of slot `s.slot`, block-causally (one eager forward);
        to_block defaults to the block before the active one, which every step recomputes anyway."""
        K = engine.K
        lo, hi = from_block * K, (s.block - 1 if to_block is None else to_block) * K
        if hi <= lo:
            return
        dev = engine.device
        pos = torch.arange(lo, hi, device=dev)
        keep = torch.arange(self.cache.max_len, device=dev)[None, :] < ((pos // K + 1) * K)[:, None]
        view = self.cache.row_view(s.slot)
        view.write_pos = pos[None]
        engine.model(input_ids=engine.slots.canvas[s.slot:s.slot + 1, lo:hi], attention_mask=keep[None, None],
                     position_ids=pos[None], cache=view, return_logits=False)


def static_forward(engine, ready: list) -> list:
    """Run the compiled step for the sequences of `ready` that decode a block and apply its outcome; returns
    the others (rows in a Multi-Block Editing pass, decoded eagerly by the caller)."""
    blocks = [s for s in ready if s.mbe_start is None]
    if not blocks:
        return ready
    st, B, dev = engine.static, engine.max_batch, engine.device
    by_slot = {s.slot: s for s in blocks}
    rows = list(by_slot)
    # block, start, limit, forwards of every slot; an inactive slot's values are never read (the step's writes
    # are masked by `active`), so they stay 0
    inputs = torch.zeros(4, B, dtype=torch.long, device=dev)
    inputs[:, rows] = torch.tensor([[s.block, s.start, s.max_new, s.forwards] for s in blocks], device=dev).T
    block, start, limit, forwards = inputs
    active = torch.zeros(B, dtype=torch.bool, device=dev)
    active[rows] = True
    cfg = engine.cfg
    noise = None  # a greedy step never reads noise (`StaticDecodeStep` takes None then)
    if cfg.temperature > 0:
        gens = [by_slot[r].generator if r in by_slot else None for r in range(B)]
        noise = draw_noise(gens, [r in by_slot for r in range(B)], (engine.K, engine.model.config.vocab_size), dev)
    sl = engine.slots
    outcome, cur = st.step(sl.canvas, sl.trace, sl.post_steps, sl.block_iters, block, start, limit, forwards,
                           active, noise)
    engine.num_forwards += 1
    engine.row_forwards += len(blocks)
    rows = outcome.tolist()  # the one host synchronisation of the iteration
    for r, s in by_slot.items():
        done, _wrote, eos, n_t2t, n_del, n_ins = rows[r]
        s.forwards += 1
        s.turn_forwards += 1
        s.edits += n_t2t
        s.deletes += n_del
        s.inserts += n_ins
        if n_del + n_ins:
            s.lev_drafts.setdefault(s.block, cur[r].tolist())
        if done:
            # the step's own flag: after_block then reads no canvas back (a multi-turn row's turn text does)
            engine.block_ended(s, eos=bool(eos))
    return [s for s in ready if s.mbe_start is not None and s.slot not in by_slot]
