"""The rollout engine: one long-lived, continuous-batching token service for every draft-and-edit rollout.

Clients (`generate`, the multi-turn driver, partial rollouts, the server's driver, the agent gateway) `submit`
sequences, each with its own prompt, generator and `DecodeConfig`; `extend` a paused sequence with tokens (an
observation) at its next block boundary; `end` or `abort` one; `drain` / `export` / `adopt` sequences at block
boundaries around a weight change (`set_version`). Each `Engine.step`:
  1. admits queued sequences into free slots (a slot is a row of the runner's canvas and KV cache), up to
     `max_batch` rows; a sequence whose prompt blocks a live sequence holds waits one step and copies them;
  2. runs ONE forward over the rows that are ready (decoding a block, or in a Multi-Block Editing pass), through
     the runner (`rollout.runner`: eager or compiled; the engine never asks which);
  3. moves each row on by its outcome (`rollout.lifecycle`): next block, MBE window, a paused turn (the client
     decides what follows), finished (its tokens are copied out and its slot is free at once).
A sequence's tokens depend only on its prompt, its generator, its settings and the weights: sampling draws from
its own generator only when it takes part in a forward, and the attention of one row never sees another, so
neither its neighbours, nor their settings, nor its admission time change what it decodes
(`scripts/decode_baselines.py` checks it against the recorded decoders).

The engine knows nothing of environments or tokenisers: a multi-turn sequence carries a `turn_rule` from its
client (`rollout.multiturn`), called with the turn's tokens when a block ends, which says whether the turn is over.
"""
from __future__ import annotations

import sys
import time
from collections import deque

import torch

from ebpo.core.turns import round_up

from .lifecycle import after_mbe, block_ended, release, settings_for, start_block
from .runners import make_runner
from .sequence import FINISHED, QUEUED, WAITING, Sequence


def eos_ids_of(config) -> set[int]:
    """The model config's EOS id(s) as a set (empty when it has none)."""
    eos = config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class Engine:
    """Continuous-batching draft-and-edit decoding over `max_batch` slots of `canvas_len` positions.

    model: an `LLaDA2MoeModelLM`; cfg: the engine's `DecodeConfig` (its block size, cache and compiled step are
    the engine's; its other fields are the default settings of a sequence submitted without its own);
    on_step(StepEvent) after every forward of every sequence; version: the weights' version, recorded per block;
    share_prefix: sequences with the same whole prompt blocks compute them once (`rollout.prefix_share`).
    `paused`: sequences whose turn ended, in order, for the client to `extend` or `end`.
    """

    def __init__(self, model, cfg, *, max_batch: int, canvas_len: int, on_step=None, progress: bool = False,
                 version: int = 0, share_prefix: bool = True):
        mcfg = model.config
        self.version = int(version)  # the weights' version: recorded per block (Sequence.block_versions)
        self.holding = False  # drain(): rows at a block boundary wait, nothing is admitted
        self.model, self.cfg = model, cfg
        self.K = cfg.block_size or mcfg.block_size
        self.mask_id, self.eos_ids = int(mcfg.mask_token_id), eos_ids_of(mcfg)
        self.lev_ids = _lev_ids(cfg, mcfg)
        self.model_lev_ids = _model_lev_ids(mcfg)
        self.on_step, self.progress = on_step, progress
        self.T, self.max_batch = round_up(canvas_len, self.K), max(1, int(max_batch))
        self.runner = make_runner(model, cfg, max_batch=self.max_batch, canvas_len=self.T, K=self.K,
                                  mask_id=self.mask_id, eos_ids=self.eos_ids, model_lev_ids=self.model_lev_ids,
                                  share_prefix=share_prefix)
        self.free = list(range(self.max_batch))
        self.queue: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.sequences: list[Sequence] = []
        self.paused: deque[Sequence] = deque()
        self.next_id = 0  # sequence ids stay unique when a long-lived engine forgets finished sequences
        self.t0 = time.monotonic()

    @property
    def num_forwards(self) -> int:
        """Model calls of block steps and MBE passes (the compiled step counts one each)."""
        return self.runner.num_forwards

    @property
    def row_forwards(self) -> int:
        """Sum over those calls of the rows that took part."""
        return self.runner.row_forwards

    # ---- clients
    def submit(self, prompt: list[int], generator: torch.Generator | None = None, env=None,
               max_new_tokens: int | None = None, config=None, turn_rule=None) -> Sequence:
        """Queue one sequence: prompt token ids; its own generator when sampling; `env`, client data kept on the
        sequence (the multi-turn driver's environment); the generated positions of its (first) turn, default its
        config's `max_new_tokens`; its own `DecodeConfig`, default the engine's (sequences with different settings
        share forwards, see `rollout.lifecycle.settings_for`); `turn_rule(tokens) -> (reason or None, text)`, for a
        multi-turn sequence: called when a block ends with the turn's tokens, a reason pauses it. Returns its
        `Sequence`."""
        cfg = settings_for(self, config)
        s = Sequence(id=self.next_id, prompt=[int(t) for t in prompt], generator=generator, env=env,
                     max_new=int(max_new_tokens or cfg.max_new_tokens), cfg=cfg, turn_rule=turn_rule)
        if len(s.prompt) + (s.max_new if turn_rule is None else 1) > self.T:
            raise ValueError(f"Engine.submit: a prompt of {len(s.prompt)} tokens does not fit the canvas of "
                             f"{self.T} positions")
        self.next_id += 1
        self.sequences.append(s)
        self.queue.append(s)
        return s

    def extend(self, s: Sequence, ids: list[int], max_new_tokens: int) -> None:
        """Continue the paused sequence `s` (WAITING, its turn ended on a block boundary): append `ids` (an
        observation) after its last turn, then decode a new turn of at most `max_new_tokens` positions (rounded up
        to whole blocks, within the canvas). ValueError when the ids do not fit with room for one token."""
        if s.status != WAITING:
            raise ValueError(f"Engine.extend: sequence {s.id} is {s.status}, not waiting after a turn")
        lo, K = s.length, self.K
        if lo + len(ids) + 1 > self.T:
            raise ValueError(f"Engine.extend: {len(ids)} tokens after {lo} do not fit the canvas of {self.T}")
        self.runner.append(s, lo, ids)
        s.start = s.length = lo + len(ids)
        s.first_block = s.start // K
        s.num_blocks = min(round_up(s.start + max_new_tokens, K), self.T) // K
        start_block(self, s, s.start // K)
        self.runner.resume(s, lo // K - 1)

    def end(self, s: Sequence, stop: str = "aborted", failed: bool = False, error: str | None = None) -> None:
        """Stop `s` now with reason `stop` (a client that went away, an episode's limit): a queued sequence leaves
        the queue, an active or paused one frees its slot before the next forward, with what it has decoded (a
        multi-turn sequence up to its last finished turn). A finished sequence is left alone."""
        if s.status == FINISHED:
            return
        s.stop, s.failed, s.error, s.end_time = stop, failed, error, time.monotonic()
        if s in self.paused:
            self.paused.remove(s)
        if s.status == QUEUED:
            if s in self.queue:
                self.queue.remove(s)
            s.canvas, s.length, s.status = list(s.prompt), s.prompt_len, FINISHED
            return
        release(self, s, s.length if s.turn_rule is not None else s.num_blocks * self.K)

    abort = end

    def forget_finished(self) -> list[Sequence]:
        """Drop finished sequences from `sequences` (a long-lived engine must not grow); returns them."""
        done = [s for s in self.sequences if s.status == FINISHED]
        self.sequences = [s for s in self.sequences if s.status != FINISHED]
        return done

    def run(self, until=None) -> list[Sequence]:
        """Step until `until()` is true (when given) or no sequence can move; returns every sequence in submission
        order."""
        while not (until is not None and until()) and self.step():
            pass
        if self.progress and until is None:
            print(file=sys.stderr)
        return self.sequences

    run_until = run

    def step(self) -> bool:
        """One scheduler iteration (module docstring). False when no sequence can move (nothing queued, nothing
        ready: every unfinished sequence, if any, is paused for its client)."""
        if not self.holding:
            self._admit()
        waiting_prefix = [s for s in self.active if not s.held and self.runner.waits_for_prefix(s)]
        ready = [s for s in self.active if s.ready and not (self.holding and s.at_block_boundary)
                 and s not in waiting_prefix]
        if not ready:
            return bool(waiting_prefix)
        self._forward(ready)
        if self.progress:
            done = sum(s.status == FINISHED for s in self.sequences)
            print(f"\rdecode: {done}/{len(self.sequences)} sequences done, {len(ready)} rows in the last forward",
                  end="", file=sys.stderr, flush=True)
        return True

    # ---- partial rollouts: stop every sequence at a block boundary, hand them over, take them back
    def drain(self) -> None:
        """Decode until every active sequence stands at a block boundary (`Sequence.at_block_boundary`): rows
        in the middle of a block (or of an MBE window) finish it; no new block starts and nothing is admitted.
        New weights can then be loaded (`set_version`) without a block seeing two versions."""
        self.holding = True
        try:
            while any(s.ready and not s.at_block_boundary for s in self.active):
                self.step()
        finally:
            self.holding = False

    def set_version(self, version: int) -> None:
        """The weights were swapped in place (after `drain`): blocks that start from now on record `version`, and
        every slot's keys/values are recomputed under the new weights from position 0 (exactly what a block's
        conditional under the new version needs); shared prompt blocks are recomputed once."""
        if any(s.ready and not s.at_block_boundary for s in self.active):
            raise ValueError("Engine.set_version: drain() first (a block must not see two versions)")
        self.version = int(version)
        live = [s for s in self.active if not s.held]  # held ones are recomputed when their client takes them back
        for s in live:
            s.canvas, s.trace = self.runner.copy_out(s, self.T)
        reloaded: list[Sequence] = []
        for s in live:
            self.runner.load(s, reloaded)
            reloaded.append(s)

    def export(self, keep_slots: bool = False) -> list[Sequence]:
        """After `drain`: every unfinished sequence, with its canvas and trace copied out (active ones at their block
        boundaries, then the queued ones). By default they are released from this engine and `adopt` continues
        them in any engine. With `keep_slots`, the active ones stay in their slots but are held: no forward moves
        them and no other sequence waits for them until `adopt` here takes them back. Queued ones always leave."""
        out = []
        for s in list(self.active):
            if s.status == FINISHED:
                continue
            s.canvas, s.trace = self.runner.copy_out(s, self.T)
            out.append(s)
            if keep_slots:
                s.held = True
                continue
            self.runner.free(s)
            self.active.remove(s)
            self.free.append(s.slot)
            s.slot, s.held = None, False
        self.free.sort()
        self.paused = deque(s for s in self.paused if s.slot is not None)
        out += list(self.queue)
        self.queue.clear()
        gone = {id(s) for s in out if s.slot is None}
        self.sequences = [s for s in self.sequences if id(s) not in gone]
        return out

    def adopt(self, s: Sequence) -> Sequence:
        """Continue a sequence at its block boundary, under this engine's weights: one this engine holds
        (`export(keep_slots=True)`) in its slot, one exported by another engine (`export`) in a free slot. Either way
        its keys/values are recomputed from position 0 by its next forward (exactly what the block's conditional
        under the current version needs), sharing a prompt with the sequences adopted before it as a new one
        would, so a held sequence decodes with the same forwards as a handed-over one (a resumed run's). Queued
        sequences are queued again."""
        if resident(self, s):  # its keys/values are recomputed as an adopted one's: the same forwards either way
            s.held = False
            self.active = [o for o in self.active if o is not s] + [s]  # in adoption order, as an adopted one
            self.runner.reset_block(s)
            self.runner.load(s, [o for o in self.active[:-1] if not o.held])
            return s
        if s.status != QUEUED:  # refuse before recording it: a refused sequence is not this engine's
            sid = self.next_id
            if not s.at_block_boundary:
                raise ValueError(f"Engine.adopt: sequence {sid} is not at a block boundary (status {s.status})")
            if len(s.canvas) > self.T and any(t != self.mask_id for t in s.canvas[self.T:]):
                raise ValueError(f"Engine.adopt: sequence {sid} holds {len(s.canvas)} positions, the canvas {self.T}")
            if not self.free:
                raise ValueError("Engine.adopt: no free slot (adopt before submitting new sequences)")
        s.id, s.held = self.next_id, False
        self.next_id += 1
        if s.cfg is None:
            s.cfg = self.cfg
        self.sequences.append(s)
        if s.status == QUEUED:
            s.slot = None
            self.queue.append(s)
            return s
        s.slot = self.free.pop(0)
        if s.env is not None and len(s.generated) < self.T:  # the per-position turn records span the canvas
            s.generated += [False] * (self.T - len(s.generated))
            s.segment += [-1] * (self.T - len(s.segment))
        self.runner.reset_block(s)
        self.runner.load(s, self.active)
        self.active.append(s)
        return s

    # ---- admission and one forward
    def _admit(self) -> None:
        K = self.K
        while self.queue and self.free:
            s = self.queue.popleft()
            s.slot = self.free.pop(0)
            P = s.prompt_len
            s.start = s.length = P
            s.first_block = P // K
            s.num_blocks = min(-(-(P + s.max_new) // K), self.T // K)
            s.new_block(P // K)
            self.runner.reset_block(s)
            self.runner.place(s, self.active)
            self.active.append(s)

    def _forward(self, ready: list[Sequence]) -> None:
        for s in ready:
            if s.mbe_start is None:
                s.block_versions.setdefault(s.block, self.version)
        in_block = [s.mbe_start is None for s in ready]  # before a block's end opens a window
        events = [] if self.on_step is not None else None
        outcomes = self.runner.forward(ready, events)
        for s, o, b in zip(ready, outcomes, in_block):
            if b and o.done:
                block_ended(self, s, o.eos)
        for s, o, b in zip(ready, outcomes, in_block):
            if not b and o.done:
                after_mbe(self, s)
        by_id = {s.id: s for s in ready}
        for ev in events or []:
            s = by_id[ev.seq]
            ev.finished = s.status == FINISHED
            end = s.num_blocks * self.K
            ev.canvas = s.canvas[:end] if ev.finished else self.runner.read(s, 0, end)
            self.on_step(ev)


def resident(engine: Engine, s: Sequence) -> bool:
    """`s` is held in one of `engine`'s slots (`Engine.export(keep_slots=True)`), not a copy from elsewhere."""
    return s.held and s.slot is not None and any(x is s for x in engine.active)


def _model_lev_ids(mcfg) -> tuple[int, int] | None:
    """(DELETE id, INSERT id) of a model trained for Levenshtein editing, else None."""
    if getattr(mcfg, "delete_token_id", None) is None:
        return None
    return int(mcfg.delete_token_id), int(mcfg.insert_token_id)


def _lev_ids(cfg, mcfg) -> tuple[int, int] | None:
    if not cfg.levenshtein:
        return None
    if getattr(mcfg, "delete_token_id", None) is None:
        raise ValueError("DecodeConfig.tau_delete / tau_insert: the model's config has no delete_token_id / "
                         "insert_token_id; Levenshtein editing needs a model trained with them")
    return int(mcfg.delete_token_id), int(mcfg.insert_token_id)
