"""`CompiledRunner`, the compiled step (`rollout.compiled`) behind the runner seam (`rollout.runner`): its
fixed-size KV cache, the per-slot inputs it reads each iteration, and the eager `refill` forwards that give the
cache what the step cannot compute itself.

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
from .runner import EagerRunner, RowOutcome


class CompiledRunner(EagerRunner):
    """The compiled step over `max_batch` slots: rows decoding a block take the fixed-shape step, rows in a
    Multi-Block Editing pass the eager forward without a cache (it recomputes the prefix, which is exact)."""

    def __init__(self, model, cfg, *, eos_ids: set[int], **kw):
        super().__init__(model, cfg, share_prefix=False, use_cache=False, **kw)
        param = next(model.parameters())
        B, T, K = self.B, self.T, self.K
        self.cache_static = StaticKVCache.for_model(model.config, B, T + K, dtype=param.dtype, device=param.device)
        lev = self.model_lev_ids if cfg.levenshtein else None
        self.cfg = cfg
        self.step = compiled_step(StaticDecodeStep(model, cfg, K, T, self.mask_id, eos_ids, self.cache_static, lev))

    def place(self, s, active: list) -> None:
        """A sequence was admitted into slot `s.slot`: its prompt's whole blocks into the cache."""
        super().place(s, active)
        self.refill(s, 0)

    def load(self, s, active: list) -> None:
        """An adopted sequence: its blocks before the active one (a waiting one: before its turn's last block)."""
        super().load(s, active)
        self.refill(s, 0, s.length // self.K - 1 if not s.ready else None)

    def resume(self, s, from_block: int) -> None:
        """A turn resumes after its observation: the last turn's final block onwards into the cache."""
        self.refill(s, from_block)

    def invalidate(self, s, from_block: int, to_block: int) -> None:
        self.refill(s, from_block, to_block)

    def refill(self, s, from_block: int, to_block: int | None = None) -> None:
        """Keys/values of blocks [from_block, to_block) of slot `s.slot`, block-causally (one eager forward);
        to_block defaults to the block before the active one, which every step recomputes anyway."""
        K = self.K
        lo, hi = from_block * K, (s.block - 1 if to_block is None else to_block) * K
        if hi <= lo:
            return
        dev = self.device
        pos = torch.arange(lo, hi, device=dev)
        keep = torch.arange(self.cache_static.max_len, device=dev)[None, :] < ((pos // K + 1) * K)[:, None]
        view = self.cache_static.row_view(s.slot)
        view.write_pos = pos[None]
        self.model(input_ids=self.slots.canvas[s.slot:s.slot + 1, lo:hi], attention_mask=keep[None, None],
                   position_ids=pos[None], cache=view, return_logits=False)

    def forward(self, ready: list, events: list | None) -> list[RowOutcome]:
        """Block rows through the compiled step, MBE rows through the eager forward (`EagerRunner.forward`)."""
        out: list = [None] * len(ready)
        block_i = [i for i, s in enumerate(ready) if s.mbe_start is None]
        mbe_i = [i for i, s in enumerate(ready) if s.mbe_start is not None]
        if block_i:
            for i, o in zip(block_i, self._static_forward([ready[i] for i in block_i])):
                out[i] = o
        if mbe_i:
            for i, o in zip(mbe_i, super().forward([ready[i] for i in mbe_i], events)):
                out[i] = o
        return out

    def _static_forward(self, blocks: list) -> list[RowOutcome]:
        B, dev = self.B, self.device
        by_slot = {s.slot: s for s in blocks}
        rows = list(by_slot)
        # block, start, limit, forwards of every slot; an inactive slot's values are never read (the step's writes
        # are masked by `active`), so they stay 0
        inputs = torch.zeros(4, B, dtype=torch.long, device=dev)
        inputs[:, rows] = torch.tensor([[s.block, s.start, s.max_new, s.forwards] for s in blocks], device=dev).T
        block, start, limit, forwards = inputs
        active = torch.zeros(B, dtype=torch.bool, device=dev)
        active[rows] = True
        noise = None  # a greedy step never reads noise (`StaticDecodeStep` takes None then)
        if self.cfg.temperature > 0:
            gens = [by_slot[r].generator if r in by_slot else None for r in range(B)]
            noise = draw_noise(gens, [r in by_slot for r in range(B)], (self.K, self.model.config.vocab_size), dev)
        sl = self.slots
        outcome, cur = self.step(sl.canvas, sl.trace, sl.post_steps, sl.block_iters, block, start, limit, forwards,
                                 active, noise)
        self.num_forwards += 1
        self.row_forwards += len(blocks)
        table = outcome.tolist()  # the one host synchronisation of the iteration
        out = []
        for s in blocks:
            done, _wrote, eos, n_t2t, n_del, n_ins = table[s.slot]
            s.forwards += 1
            s.turn_forwards += 1
            s.edits += n_t2t
            s.deletes += n_del
            s.inserts += n_ins
            if n_del + n_ins:
                s.lev_drafts.setdefault(s.block, cur[s.slot].tolist())
            # the step's own EOS flag: the engine then reads no canvas back (a multi-turn row's turn text does)
            out.append(RowOutcome(bool(done), bool(eos)))
        return out
