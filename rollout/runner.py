"""The runner seam of the rollout engine: what owns the model, the per-slot device state and the KV cache, and
runs one forward over a plan of rows.

`Engine` (rollout/engine.py) decides which sequences take part in a forward and what a block's end means; a
runner does the rest, behind these calls (the engine never asks which runner it has):

    place(s) / load(s, canvas, trace)   a sequence enters its slot (a new prompt / an adopted sequence)
    free(s)                             it left its slot (its keys/values go back)
    append(s, lo, ids)                  tokens after a turn (an observation) at a block boundary
    reset_block(s)                      a new active block: its counters restart
    read(s, lo, hi) / copy_out(s, end)  canvas tokens (host lists)
    waits_for_prefix(s)                 the sequence waits one step for a shared prompt prefix
    forward(ready, events)              ONE forward over the ready rows, decisions applied, per-row outcomes
    invalidate(s, from_block, to_block) keys/values of blocks an MBE pass changed are stale
    resume(s, from_block)               keys/values a turn's next forward cannot compute itself

`EagerRunner` is the reference implementation: a prefix KV cache in block-sized pages (`PagedKVCache`), the
batched forward of `rollout.forward`, the decisions of `rollout.block_apply`, shared prompt prefixes
(`rollout.prefix_share`).
`rollout.static_slots.CompiledRunner` runs block rows as one fixed-shape compiled step instead. A tensor- and
expert-parallel runner (`rollout.parallel_runner`) or another backend plugs in here the same way;
`rollout.runners.make_runner` picks one when an engine is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ebpo.model.paged_cache import PagedKVCache

from .block_apply import SlotTensors, apply_block_steps, apply_mbe_pass
from .forward import plan_rows, row_candidates, run_model
from .prefix_share import claim, prompt_tokens_in, settle


@dataclass
class RowOutcome:
    """What one forward did to one row: `done` the block (or, for an MBE row, the window's passes) ended;
    `eos` whether the generated region holds EOS when the runner already knows it (None: read the canvas)."""

    done: bool
    eos: bool | None = None


class EagerRunner:
    """The eager runner over `max_batch` slots of `canvas_len` (T) positions (module docstring).

    model: an `LLaDA2MoeModelLM`; cfg: the engine's `DecodeConfig` (use_cache, block size); K: the block size;
    mask_id / model_lev_ids: the model's [MASK] and (DELETE, INSERT) ids; share_prefix: copy shared prompt blocks.
    Counters: num_forwards (model calls), row_forwards (rows in them), prompt_tokens_computed.
    """

    def __init__(self, model, cfg, *, max_batch: int, canvas_len: int, K: int, mask_id: int, model_lev_ids,
                 share_prefix: bool = True, use_cache: bool | None = None):
        param = next(model.parameters())
        self.model, self.K, self.T, self.B, self.mask_id = model, K, canvas_len, max_batch, mask_id
        self.model_lev_ids = model_lev_ids
        self.device = param.device
        B, T, dev = max_batch, canvas_len, param.device
        self.slots = SlotTensors(canvas=torch.full((B, T), mask_id, dtype=torch.long, device=dev),
                                 trace=torch.full((B, T), -1, dtype=torch.long, device=dev),
                                 post_steps=torch.zeros(B, dtype=torch.long, device=dev),
                                 block_iters=torch.zeros(B, dtype=torch.long, device=dev))
        use_cache = cfg.use_cache if use_cache is None else use_cache
        # pages of one block that rows reference: memory follows the live tokens, a shared prompt is held once
        self.cache = (PagedKVCache.for_model(model.config, B, T, dtype=param.dtype, device=dev, page=K)
                      if use_cache else None)
        self.share_prefix = share_prefix and self.cache is not None
        self.num_forwards = 0
        self.row_forwards = 0
        self.prompt_tokens_computed = 0

    # ---- slots
    def place(self, s, active: list) -> None:
        """`s` (prompt, slot set) enters its slot: the canvas holds its prompt then [MASK]s; its cache row is empty
        or, when a live sequence of `active` holds the same whole prompt blocks, is about to copy them."""
        P, r = s.prompt_len, s.slot
        self.slots.canvas[r].fill_(self.mask_id)
        self.slots.canvas[r, :P] = torch.tensor(s.prompt, dtype=torch.long, device=self.device)
        self.slots.trace[r].fill_(-1)
        self._fresh_row(s, active)

    def load(self, s, active: list) -> None:
        """An adopted sequence (exported by another engine at a block boundary) enters its slot with its canvas
        and trace; its keys/values are recomputed from position 0 under this runner's weights."""
        r, n = s.slot, min(len(s.canvas), self.T)
        self.slots.canvas[r].fill_(self.mask_id)
        self.slots.canvas[r, :n] = torch.tensor(s.canvas[:n], dtype=torch.long, device=self.device)
        self.slots.trace[r].fill_(-1)
        self.slots.trace[r, :n] = torch.tensor(s.trace[:n], dtype=torch.long, device=self.device)
        self._fresh_row(s, active)

    def _fresh_row(self, s, active: list) -> None:
        if self.cache is not None:
            self.cache.truncate([s.slot], [0])
            if self.share_prefix:
                claim(s, active, self.cache, self.K)

    def append(self, s, lo: int, ids: list[int]) -> None:
        """Write `ids` at [lo, lo + len(ids)) of `s`'s canvas (what came after a turn)."""
        self.slots.canvas[s.slot, lo:lo + len(ids)] = torch.tensor(ids, dtype=torch.long, device=self.device)

    def reset_block(self, s) -> None:
        self.slots.post_steps[s.slot] = 0
        self.slots.block_iters[s.slot] = 0

    def read(self, s, lo: int, hi: int) -> list[int]:
        return self.slots.canvas[s.slot, lo:hi].tolist()

    def copy_out(self, s, end: int) -> tuple[list[int], list[int]]:
        """(canvas, trace) of `s`'s slot up to `end`, as host lists."""
        return self.slots.canvas[s.slot, :end].tolist(), self.slots.trace[s.slot, :end].tolist()

    def free(self, s) -> None:
        """`s` left its slot: its keys/values go back to the pool (pages another row reads stay)."""
        if self.cache is not None:
            self.cache.truncate([s.slot], [0])

    def waits_for_prefix(self, s) -> bool:
        return self.share_prefix and settle(s, self.cache, self.K)

    # ---- keys/values
    def invalidate(self, s, from_block: int, to_block: int) -> None:
        """Tokens of blocks [from_block, to_block] changed (an MBE pass): drop their cached keys/values."""
        if self.cache is not None:
            keep = min(self.cache.lengths[s.slot], from_block * self.K)
            if keep < self.cache.lengths[s.slot]:
                self.cache.truncate([s.slot], [keep])

    def resume(self, s, from_block: int) -> None:
        """A turn resumes after tokens were appended: the eager forward runs every uncommitted block itself."""

    # ---- one forward
    def forward(self, ready: list, events: list | None) -> list[RowOutcome]:
        """ONE model call over `ready` (each decoding its active block, or in an MBE pass over its window), the
        decisions written into the slots (`rollout.block_apply`); per row, whether its block / window ended.
        Appends `StepEvent`s to `events` when given."""
        K = self.K
        plan = plan_rows(ready, self.cache, K)
        slots = [s.slot for s in ready]
        hidden = run_model(self.model, self.slots.canvas, slots, plan, self.cache, K, self.mask_id)
        cfgs = [s.cfg for s in ready]
        levs = [self.model_lev_ids if s.cfg.levenshtein else None for s in ready]
        results = self.candidates(hidden, slots, plan, ready, cfgs, levs)
        self.num_forwards += 1
        self.row_forwards += len(ready)
        self.prompt_tokens_computed += sum(prompt_tokens_in(s, a, b) for s, a, b in zip(ready, plan.q_start, plan.q_end))
        out = [RowOutcome(False)] * len(ready)
        commit = [0] * len(ready)
        block_i = [i for i, s in enumerate(ready) if s.mbe_start is None]
        if block_i:
            done, wrote = apply_block_steps(self.slots, [ready[i] for i in block_i], [results[i] for i in block_i],
                                            [cfgs[i] for i in block_i], K, self.mask_id, [levs[i] for i in block_i],
                                            events)
            for j, i in enumerate(block_i):
                # commit the blocks before the active one; the active block too when it ended with a step that
                # wrote nothing (its keys/values were then computed from its final tokens)
                commit[i] = plan.t_start[i] - plan.q_start[i] + (K if done[j] and not wrote[j] else 0)
                out[i] = RowOutcome(done[j])
        for i, s in enumerate(ready):
            if s.mbe_start is not None:
                out[i] = RowOutcome(apply_mbe_pass(self.slots, s, results[i], plan.t_start[i], plan.t_len[i], cfgs[i],
                                                   K, events))
        if self.cache is not None:
            self.cache.commit(commit)  # MBE rows commit 0: their window keys used a non-block-causal mask
        return out

    def candidates(self, hidden, slots: list[int], plan, ready: list, cfgs: list, levs: list) -> list[tuple]:
        """Per ready row, (tok, prob, eprob) of its target span (`rollout.forward.row_candidates`)."""
        return row_candidates(self.model, hidden, self.slots.canvas, slots, plan, [s.generator for s in ready],
                              cfgs, self.mask_id, levs)
