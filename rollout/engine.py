"""The rollout engine: one continuous-batching scheduler for every draft-and-edit rollout.

Sequences are submitted to a queue. Each iteration of `Engine.step`:
  1. takes the answers of environments that have returned (multi-turn) and appends their observations;
  2. admits queued sequences into free slots (a slot is a row of the canvas and of the prefix KV cache), up to
     `max_batch` rows;
  3. runs ONE forward over the rows that are ready (decoding a block, or in a Multi-Block Editing pass);
  4. applies each row's decisions (`rollout.block_apply`: M2T / T2T, DELETE / INSERT, MBE) and moves each
     sequence on: next block, MBE window, end of turn (its text goes to `env.step`, the sequence waits),
     finished (its tokens are copied out and its slot is free for the next queued sequence at once).
A single-turn rollout is a multi-turn rollout with no environment. A sequence's tokens depend only on its
prompt, its generator and the weights: sampling draws from its own generator only when it takes part in a
forward, and the attention of one row never sees another, so neither its neighbours nor its admission time
change what it decodes (`scripts/decode_baselines.py` checks it against the recorded decoders).

With `DecodeConfig(compiled_step=True)` step 3-4 of the rows decoding a block run as one fixed-shape step
over all slots (`rollout.compiled`), compiled once; the rest of the loop is the same.
"""
from __future__ import annotations

import concurrent.futures
import sys
import time
from collections import deque

import torch

from ebpo.core.turns import TOOL_CALL_CLOSE, round_up
from ebpo.model import BlockKVCache

from .block_apply import SlotTensors, apply_block_steps, apply_mbe_pass
from .env_steps import StepRunner, unpack_step
from .forward import plan_rows, row_candidates, run_model
from .prefix_share import claim, prompt_tokens_in, settle
from .sequence import DECODING, FINISHED, MBE, QUEUED, WAITING, Sequence
from .steps import first_eos
from .trajectory import TurnRecord


def eos_ids_of(config) -> set[int]:
    """The model config's EOS id(s) as a set (empty when it has none)."""
    eos = config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


class Engine:
    """Continuous-batching draft-and-edit decoding over `max_batch` slots of `canvas_len` positions.

    model: an `LLaDA2MoeModelLM`; cfg: a `DecodeConfig`; mt: a `MultiTurnConfig` when sequences carry an
    environment (then `tokenizer` is needed to decode turns and encode observations); on_step(StepEvent) after
    every forward of every sequence; on_turn(seq id, TurnRecord) after every environment step.
    """

    def __init__(self, model, cfg, *, max_batch: int, canvas_len: int, tokenizer=None, mt=None, on_step=None,
                 on_turn=None, progress: bool = False, version: int = 0, runner: StepRunner | None = None,
                 share_prefix: bool = True):
        mcfg = model.config
        self.version = int(version)  # the weights' version: recorded per block (Sequence.block_versions)
        self.holding = False  # drain(): rows at a block boundary wait, nothing is admitted
        self.model, self.cfg, self.mt, self.tokenizer = model, cfg, mt, tokenizer
        self.K = cfg.block_size or mcfg.block_size
        self.mask_id, self.eos_ids = int(mcfg.mask_token_id), eos_ids_of(mcfg)
        self.lev_ids = _lev_ids(cfg, mcfg)
        self.model_lev_ids = _model_lev_ids(mcfg)
        self.next_id = 0  # sequence ids stay unique when a long-lived engine forgets finished sequences
        self.on_step, self.on_turn, self.progress = on_step, on_turn, progress
        param = next(model.parameters())
        self.device, self.T, self.max_batch = param.device, round_up(canvas_len, self.K), max(1, int(max_batch))
        B, dev = self.max_batch, self.device
        self.slots = SlotTensors(canvas=torch.full((B, self.T), self.mask_id, dtype=torch.long, device=dev),
                                 trace=torch.full((B, self.T), -1, dtype=torch.long, device=dev),
                                 post_steps=torch.zeros(B, dtype=torch.long, device=dev),
                                 block_iters=torch.zeros(B, dtype=torch.long, device=dev))
        self.cache = (BlockKVCache.for_model(mcfg, B, self.T, dtype=param.dtype, device=dev)
                      if cfg.use_cache and not cfg.compiled_step else None)
        self.static = None  # the compiled step's cache and inputs (rollout.static_slots)
        if cfg.compiled_step:
            from .static_slots import StaticSlots

            self.static = StaticSlots(self)
        self.free = list(range(B))
        self.queue: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.sequences: list[Sequence] = []
        self.runner = runner or (StepRunner(mt.max_workers) if mt is not None else None)
        self.t0 = time.monotonic()
        self.num_forwards = 0  # model calls of block steps and MBE passes (the compiled step counts one each)
        self.row_forwards = 0  # sum over those calls of the rows that took part
        self.prompt_tokens_computed = 0  # prompt positions run by forwards (what shared prompt prefixes save)
        self.share_prefix = share_prefix and self.cache is not None  # rollout.prefix_share

    # ---- the public loop
    def submit(self, prompt: list[int], generator: torch.Generator | None = None, env=None,
               max_new_tokens: int | None = None, config=None) -> Sequence:
        """Queue one sequence (prompt token ids; its own generator when sampling; an environment, already
        reset, for a multi-turn rollout; a single-turn length other than its config's `max_new_tokens`; its own
        `DecodeConfig`, default the engine's: sequences with different settings share forwards, see
        `settings_for`). Returns its `Sequence`, filled in as it decodes."""
        cfg = self.settings_for(config)
        s = Sequence(id=self.next_id, prompt=[int(t) for t in prompt], generator=generator, env=env,
                     max_new=int(max_new_tokens or cfg.max_new_tokens), cfg=cfg)
        if len(s.prompt) + (s.max_new if env is None else 1) > self.T:
            raise ValueError(f"Engine.submit: a prompt of {len(s.prompt)} tokens does not fit the canvas of "
                             f"{self.T} positions")
        self.next_id += 1
        self.sequences.append(s)
        self.queue.append(s)
        return s

    def settings_for(self, config):
        """The `DecodeConfig` a sequence decodes with (`config`, or the engine's when None), checked against
        what is fixed per engine: the block size (every row of a forward has the model's blocks), the prefix
        cache and the compiled step (the engine's own choices, which a request cannot change; the compiled step
        also fixes every decoding threshold: it is one graph for one setting). ValueError names the field."""
        if config is None:
            return self.cfg
        K = config.block_size or self.model.config.block_size
        if K != self.K:
            raise ValueError(f"DecodeConfig.block_size: this engine decodes blocks of {self.K} tokens, got {K}; "
                             f"the block size is fixed per engine")
        for name in ("use_cache", "compiled_step"):
            if getattr(config, name) != getattr(self.cfg, name):
                raise ValueError(f"DecodeConfig.{name}: this engine runs with {name}={getattr(self.cfg, name)}, "
                                 f"got {getattr(config, name)}; it is fixed per engine")
        if self.cfg.compiled_step and config.replace(max_new_tokens=self.cfg.max_new_tokens,
                                                     max_batch=self.cfg.max_batch) != self.cfg:
            raise ValueError("DecodeConfig: the compiled step decodes every sequence with the engine's settings; "
                             "only max_new_tokens may differ per sequence (use the eager engine for mixed settings)")
        if config.levenshtein:
            _lev_ids(config, self.model.config)
        return config

    def abort(self, s: Sequence) -> None:
        """Stop `s` now (a client that went away): a queued sequence leaves the queue, an active one frees its
        slot before the next forward. It ends FINISHED with stop "aborted" and what it had decoded so far."""
        if s.status == FINISHED:
            return
        s.stop, s.end_time = "aborted", time.monotonic()
        if s.status == QUEUED:
            if s in self.queue:
                self.queue.remove(s)
            s.status = FINISHED
            return
        self._release(s, s.num_blocks * self.K if s.env is None else s.length)

    def forget_finished(self) -> list[Sequence]:
        """Drop finished sequences from `sequences` (a long-lived engine must not grow); returns them."""
        done = [s for s in self.sequences if s.status == FINISHED]
        self.sequences = [s for s in self.sequences if s.status != FINISHED]
        return done

    def run(self) -> list[Sequence]:
        """Step until every submitted sequence is finished; returns them in submission order."""
        while self.step():
            pass
        if self.progress:
            print(file=sys.stderr)
        return self.sequences

    def run_until(self, done) -> None:
        """Step until `done()` is true or nothing is left to do."""
        while not done() and self.step():
            pass

    def step(self) -> bool:
        """One scheduler iteration (module docstring). False when nothing is left to do."""
        self._poll_environments()
        if not self.holding:
            self._admit()
        waiting_prefix = [s for s in self.active if self.share_prefix and settle(s, self.cache, self.K)]
        ready = [s for s in self.active if s.ready and not (self.holding and s.at_block_boundary)
                 and s not in waiting_prefix]
        waiting = [s for s in self.active if s.status == WAITING]
        if self.mt is not None and not self.mt.continue_ready and waiting:
            ready = []  # baseline of `ebpo bench agent`: the batch pauses while any sequence waits
        if not ready:
            if not waiting:
                return bool(self.queue) or bool(waiting_prefix)
            concurrent.futures.wait([s.future for s in waiting], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            return True
        self._forward(ready)
        if self.progress:
            done = sum(s.status == FINISHED for s in self.sequences)
            print(f"\rdecode: {done}/{len(self.sequences)} sequences done, {len(ready)} rows in the last forward",
                  end="", file=sys.stderr, flush=True)
        return True

    # ---- admission and the end of a sequence
    def _admit(self) -> None:
        while self.queue and self.free:
            s = self.queue.popleft()
            s.slot = self.free.pop(0)
            self._place(s)
            self.active.append(s)
            if s.env is not None and s.prompt_len >= self._budget():
                self._end_trajectory(s, "max_total_tokens")

    # ---- partial rollouts: stop every sequence at a block boundary, hand them over, take them back
    def drain(self) -> None:
        """Decode until every active sequence stands at a block boundary (`Sequence.at_block_boundary`): rows
        in the middle of a block (or of an MBE window) finish it; no new block starts and nothing is admitted.
        New weights can then be loaded without a block seeing two versions."""
        self.holding = True
        try:
            while any(s.ready and not s.at_block_boundary for s in self.active):
                self.step()
        finally:
            self.holding = False

    def export(self) -> list[Sequence]:
        """After `drain`: every unfinished sequence (active ones with their canvas and trace copied out, and
        the queued ones), released from this engine; `adopt` continues them in another engine."""
        out = []
        for s in list(self.active):
            if s.status == FINISHED:
                continue
            s.canvas = self.slots.canvas[s.slot].tolist()
            s.trace = self.slots.trace[s.slot].tolist()
            self.active.remove(s)
            self.free.append(s.slot)
            s.slot = None
            out.append(s)
        self.free.sort()
        out += list(self.queue)
        self.queue.clear()
        return out

    def adopt(self, s: Sequence) -> Sequence:
        """Continue a sequence exported by another engine (`export`) at its block boundary, under this
        engine's weights: its keys/values are recomputed from position 0 by its next forward (exactly what the
        block's conditional under the new version needs). Queued sequences are queued again."""
        if s.status != QUEUED:  # refuse before recording it: a refused sequence is not this engine's
            sid = self.next_id
            if not s.at_block_boundary:
                raise ValueError(f"Engine.adopt: sequence {sid} is not at a block boundary (status {s.status})")
            if len(s.canvas) > self.T and any(t != self.mask_id for t in s.canvas[self.T:]):
                raise ValueError(f"Engine.adopt: sequence {sid} holds {len(s.canvas)} positions, the canvas {self.T}")
            if not self.free:
                raise ValueError("Engine.adopt: no free slot (adopt before submitting new sequences)")
        s.id = self.next_id
        self.next_id += 1
        if s.cfg is None:
            s.cfg = self.cfg
        self.sequences.append(s)
        if s.status == QUEUED:
            self.queue.append(s)
            return s
        s.slot = r = self.free.pop(0)
        n = min(len(s.canvas), self.T)
        self.slots.canvas[r].fill_(self.mask_id)
        self.slots.canvas[r, :n] = torch.tensor(s.canvas[:n], dtype=torch.long, device=self.device)
        self.slots.trace[r].fill_(-1)
        self.slots.trace[r, :n] = torch.tensor(s.trace[:n], dtype=torch.long, device=self.device)
        self.slots.post_steps[r] = 0
        self.slots.block_iters[r] = 0
        if self.cache is not None:
            self.cache.truncate([r], [0])
            if self.share_prefix:
                claim(s, self.active, self.cache, self.K)
        if s.env is not None and len(s.generated) < self.T:  # the per-position turn records span the canvas
            s.generated += [False] * (self.T - len(s.generated))
            s.segment += [-1] * (self.T - len(s.segment))
        self.active.append(s)
        if self.static is not None:
            self.static.refill(self, s, 0, s.turns[-1].end // self.K - 1 if s.status == WAITING else None)
        return s

    def _place(self, s: Sequence) -> None:
        K, P, r = self.K, s.prompt_len, s.slot
        self.slots.canvas[r].fill_(self.mask_id)
        self.slots.canvas[r, :P] = torch.tensor(s.prompt, dtype=torch.long, device=self.device)
        self.slots.trace[r].fill_(-1)
        if self.cache is not None:
            self.cache.truncate([r], [0])
            if self.share_prefix:
                claim(s, self.active, self.cache, K)
        s.start = s.length = P
        s.first_block = P // K
        if s.env is None:
            s.num_blocks = -(-(P + s.max_new) // K)
        else:
            s.num_blocks = self._turn_end_block(P)
            s.generated, s.segment = [False] * self.T, [0] * P + [-1] * (self.T - P)
        self._start_block(s, P // K)
        if self.static is not None:
            self.static.place(self, s)

    def _start_block(self, s: Sequence, block: int) -> None:
        s.new_block(block)
        self.slots.post_steps[s.slot] = 0
        self.slots.block_iters[s.slot] = 0

    def _release(self, s: Sequence, end: int) -> None:
        """Copy the sequence's canvas [0, end) and trace out of its slot; free the slot."""
        s.canvas = self.slots.canvas[s.slot, :end].tolist()
        s.trace = self.slots.trace[s.slot, :end].tolist()
        s.status = FINISHED
        self.active.remove(s)
        self.free.append(s.slot)
        self.free.sort()

    # ---- one forward
    def _forward(self, ready: list[Sequence]) -> None:
        for s in ready:
            if s.mbe_start is None:
                s.block_versions.setdefault(s.block, self.version)
        if self.static is not None:  # the rows decoding a block take the fixed-shape step; MBE rows stay eager
            from .static_slots import static_forward

            ready = static_forward(self, ready)
            if not ready:
                return
        plan = plan_rows(ready, self.cache, self.K)
        slots = [s.slot for s in ready]
        hidden = run_model(self.model, self.slots.canvas, slots, plan, self.cache, self.K, self.mask_id)
        cfgs, levs = [s.cfg for s in ready], [self._lev_of(s) for s in ready]
        results = row_candidates(self.model, hidden, self.slots.canvas, slots, plan, [s.generator for s in ready],
                                 cfgs, self.mask_id, levs)
        self.num_forwards += 1
        self.row_forwards += len(ready)
        self.prompt_tokens_computed += sum(prompt_tokens_in(s, a, b) for s, a, b in zip(ready, plan.q_start, plan.q_end))
        events = [] if self.on_step is not None else None
        commit = [0] * len(ready)
        block_i = [i for i, s in enumerate(ready) if s.mbe_start is None]
        mbe_i = [i for i, s in enumerate(ready) if s.mbe_start is not None]  # before a block's end opens a window
        if block_i:
            done, wrote = apply_block_steps(self.slots, [ready[i] for i in block_i], [results[i] for i in block_i],
                                            [cfgs[i] for i in block_i], self.K, self.mask_id,
                                            [levs[i] for i in block_i], events)
            for j, i in enumerate(block_i):
                # commit the blocks before the active one; the active block too when it ended with a step that
                # wrote nothing (its keys/values were then computed from its final tokens)
                commit[i] = plan.t_start[i] - plan.q_start[i] + (self.K if done[j] and not wrote[j] else 0)
                if done[j]:
                    self.block_ended(ready[i])
        for i in mbe_i:
            if apply_mbe_pass(self.slots, ready[i], results[i], plan.t_start[i], plan.t_len[i], cfgs[i], self.K,
                              events):
                self._mbe_over(ready[i])
        if self.cache is not None:
            self.cache.commit(commit)  # MBE rows commit 0: their window keys used a non-block-causal mask
        by_id = {s.id: s for s in ready}
        for ev in events or []:
            s = by_id[ev.seq]
            ev.finished = s.status == FINISHED
            end = s.num_blocks * self.K
            ev.canvas = s.canvas[:end] if ev.finished else self.slots.canvas[s.slot, :end].tolist()
            self.on_step(ev)

    # ---- what happens when a block ends
    def block_ended(self, s: Sequence, eos: bool | None = None) -> None:
        """The active block of `s` ended: an MBE window if MBE is on and the turn has an earlier block, else
        `after_block` (eos: whether the generated region holds EOS, when the caller already knows)."""
        lo = self._same_version_from(s)
        if s.cfg.mbe_window > 0 and s.block > lo:
            s.mbe_start = max(lo, s.block - s.cfg.mbe_window)
            s.mbe_passes, s.mbe_first_changed, s.status = 0, None, MBE
        else:
            self.after_block(s, eos)

    @staticmethod
    def _same_version_from(s: Sequence) -> int:
        """The earliest block of the current turn from which every block up to the active one was decoded
        under the active block's version: MBE never rewrites a block of another version (each block's
        behaviour term must be one version's conditional). Without weight changes: the turn's first block."""
        b, v = s.block, s.block_versions.get(s.block)
        while b > s.first_block and s.block_versions.get(b - 1) == v:
            b -= 1
        return b

    def _mbe_over(self, s: Sequence) -> None:
        if self.cache is not None and s.mbe_first_changed is not None:
            # the edit invalidates the cached keys/values from the earliest edited block on
            keep_len = min(self.cache.lengths[s.slot], s.mbe_first_changed * self.K)
            if keep_len < self.cache.lengths[s.slot]:
                self.cache.truncate([s.slot], [keep_len])
        if self.static is not None and s.mbe_first_changed is not None:
            self.static.refill(self, s, s.mbe_first_changed, s.block)
        s.mbe_start, s.status = None, DECODING
        self.after_block(s)

    def after_block(self, s: Sequence, eos: bool | None = None) -> None:
        """Next block, end of turn or end of sequence, by the block's content (eos: whether the generated region
        holds EOS, when the caller already knows; read for single-turn rows only, a turn's end reads its text)."""
        K = self.K
        if s.env is None:
            end = min(s.prompt_len + s.max_new, (s.block + 1) * K)
            if eos is None:
                eos = first_eos(self.slots.canvas[s.slot, s.prompt_len:end].tolist(), self.eos_ids) is not None
            if (s.cfg.stop_at_eos and eos) or s.block + 1 >= s.num_blocks:
                self._release(s, s.num_blocks * K)
            else:
                self._start_block(s, s.block + 1)
            return
        text, has_eos = self._turn_text(s, (s.block + 1) * K)
        if has_eos:
            self._finish_turn(s, "eos", text)
        elif self.mt.stop_at_tool_call and TOOL_CALL_CLOSE in text:
            self._finish_turn(s, "tool_call", text)
        elif s.block + 1 >= s.num_blocks:
            self._finish_turn(s, "budget", text)
        else:
            self._start_block(s, s.block + 1)

    # ---- multi-turn: turns, environments, observations
    def _budget(self) -> int:
        return min(self.T, self.mt.max_total_tokens)

    def _turn_end_block(self, start: int) -> int:
        K = self.K
        return min(round_up(start + self.mt.max_turn_tokens, K), round_up(self._budget(), K), self.T) // K

    def _turn_text(self, s: Sequence, end: int) -> tuple[str, bool]:
        toks = self.slots.canvas[s.slot, s.start:end].tolist()
        cut = first_eos(toks, self.eos_ids)
        if cut is not None:
            toks = toks[:cut]
        return self.tokenizer.decode(toks, skip_special_tokens=True), cut is not None

    def _finish_turn(self, s: Sequence, finished_by: str, text: str) -> None:
        end = (s.block + 1) * self.K
        tag = 2 * len(s.turns) + 1
        for i in range(s.start, end):
            s.generated[i], s.segment[i] = True, tag
        s.length = end
        s.turns.append(TurnRecord(index=len(s.turns), start=s.start, end=end, text=text, finished_by=finished_by,
                                  forwards=s.turn_forwards))
        s.turn_forwards = 0
        s.submitted = time.monotonic()
        s.future = self.runner.submit(s.env, text)
        s.status = WAITING

    def _end_trajectory(self, s: Sequence, stop: str, failed: bool = False, error: str | None = None) -> None:
        s.stop, s.failed, s.error, s.end_time = stop, failed, error, time.monotonic()
        self._release(s, s.length)

    def _poll_environments(self) -> None:
        for s in [s for s in self.active if s.status == WAITING]:
            self._rejoin(s)

    def _rejoin(self, s: Sequence) -> None:
        """Take the step's result (done or timed out): end the trajectory, or append the observation."""
        fut, turn = s.future, s.turns[-1]
        if not fut.done():
            if time.monotonic() - s.submitted < self.mt.step_timeout_s:
                return
            turn.error = f"env.step timed out after {self.mt.step_timeout_s:g} s"
            turn.env_latency_s = time.monotonic() - s.submitted
            s.future = None
            return self._end_trajectory(s, "env_timeout", True, turn.error)
        s.future = None
        try:
            value, latency = fut.result()
            obs, reward, done, info = unpack_step(value)
        except Exception as e:  # the environment's failure ends this trajectory only
            turn.error = f"{type(e).__name__}: {str(e)[:200]}"
            turn.env_latency_s = time.monotonic() - s.submitted
            return self._end_trajectory(s, "env_error", True, turn.error)
        turn.reward, turn.done, turn.info, turn.env_latency_s = reward, done, info, latency
        turn.tool_calls = list(info.get("tool_calls") or [])
        turn.wait_s = time.monotonic() - s.submitted
        if self.on_turn is not None:
            self.on_turn(s.id, turn)
        if done:
            return self._end_trajectory(s, "done")
        if len(s.turns) >= self.mt.max_turns:
            return self._end_trajectory(s, "max_turns")
        self._append_observation(s, turn, obs)

    def _append_observation(self, s: Sequence, turn: TurnRecord, obs: str | None) -> None:
        given = turn.info.pop("observation_ids", None)  # an environment that owns tokenisation (the agent gateway)
        if given is not None:
            obs_ids = [int(t) for t in given]
        else:
            obs_ids = self.tokenizer(self.mt.observation_template.format(observation=obs or ""),
                                     add_special_tokens=False)["input_ids"]
        lo = s.length
        if lo + len(obs_ids) + 1 > self._budget():
            empty = len(self.tokenizer(self.mt.observation_template.format(observation=""),
                                       add_special_tokens=False)["input_ids"])
            if lo + empty + 1 > self._budget():  # the turns spent the budget: no observation could fit
                return self._end_trajectory(s, "max_total_tokens")
            # the observation's own length ends the trajectory: a named stop, not a silent end of the budget
            turn.observation = obs
            why = (f"observation of {len(obs_ids)} tokens does not fit: {lo} tokens so far, "
                   f"max_total_tokens {self._budget()}")
            return self._end_trajectory(s, "observation_overflow", error=why)
        turn.observation, turn.obs_start, turn.obs_end = obs, lo, lo + len(obs_ids)
        self.slots.canvas[s.slot, lo:lo + len(obs_ids)] = torch.tensor(obs_ids, dtype=torch.long, device=self.device)
        for i in range(lo, lo + len(obs_ids)):
            s.segment[i] = 2 * len(s.turns)
        s.start = s.length = lo + len(obs_ids)
        s.first_block = s.start // self.K
        s.num_blocks = self._turn_end_block(s.start)
        self._start_block(s, s.start // self.K)
        if self.static is not None:
            self.static.resume(self, s)


    def _lev_of(self, s: Sequence) -> tuple[int, int] | None:
        return self.model_lev_ids if s.cfg.levenshtein else None


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
