"""`EngineDriver`: one thread that owns the rollout engines of a server and feeds them from many callers.

Callers (HTTP request handlers, the agent gateway) call `submit(...)` from any thread and get a
`concurrent.futures.Future` of the finished `rollout.sequence.Sequence`. Only the driver thread touches an
engine: it moves submissions from a thread-safe inbox into the engines between two `Engine.step` calls, so
a request that arrives while a batch is decoding joins it at the next forward (continuous batching), and the
engine itself needs no lock.

An engine decodes every row of a forward with one `DecodeConfig`, so requests are grouped into *lanes*, one
engine per distinct config (preset, thresholds, temperature, ...; `max_new_tokens` is per sequence and does
not split lanes); requests of one lane share forwards. A
lane whose engine has nothing left to do is dropped once more than `max_lanes` lanes exist. A sequence's
tokens depend only on its prompt, generator and the weights (`rollout.engine`), never on its lane-mates.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass, field

import torch

from rollout.engine import Engine
from rollout.sequence import FINISHED


@dataclass
class _Submission:
    prompt: list[int]
    config: object  # DecodeConfig
    generator: torch.Generator | None
    max_new: int | None
    env: object | None
    future: concurrent.futures.Future
    on_start: object | None = None


@dataclass
class _Lane:
    engine: Engine
    pending: list = field(default_factory=list)  # (Sequence, Future) pairs not finished yet

    @property
    def idle(self) -> bool:
        return not self.pending and not self.engine.queue and not self.engine.active


class EngineDriver:
    """Runs the engines of `model` in a daemon thread (`start()`; `close()` stops it).

    max_batch: most sequences decoding at once per lane; max_len: the canvas length of every sequence
    (prompt + generated tokens, + observations for multi-turn), rounded up to whole blocks;
    mt: a `rollout.multiturn.MultiTurnConfig` for sequences that carry an environment (the agent gateway),
    None for single-turn serving; max_lanes: idle lanes (engines) kept beyond this many are dropped.
    Counters (read from any thread): num_forwards (model calls over all lanes), row_forwards (rows in them).
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 16, max_len: int = 1024, mt=None, max_lanes: int = 4):
        self.model, self.tokenizer, self.mt = model, tokenizer, mt
        self.max_batch, self.max_len, self.max_lanes = int(max_batch), int(max_len), int(max_lanes)
        self.lanes: dict = {}  # DecodeConfig -> _Lane
        self.inbox: queue.Queue = queue.Queue()
        self.num_forwards = 0
        self.row_forwards = 0
        self._counted: dict = {}  # lane config -> (num_forwards, row_forwards) already added to the totals
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> "EngineDriver":
        self._thread = threading.Thread(target=self._loop, name="ebpo-engine-driver", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, prompt: list[int], config, generator: torch.Generator | None = None,
               max_new_tokens: int | None = None, env=None, on_start=None) -> concurrent.futures.Future:
        """Queue one sequence (token ids, its `DecodeConfig`, its own generator when sampling, a single-turn
        length, an environment for a multi-turn sequence); the Future gives the finished `Sequence` (or the
        ValueError the engine raised: a prompt too long for the canvas, settings the model cannot decode with,
        such as DELETE / INSERT without their token ids). on_start(sequence, engine)
        is called in the driver thread once the engine holds the sequence (the agent gateway reads a waiting
        turn's token ids from the engine's slot through it)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"the engine driver stopped: {self.error!r}"))
            return fut
        self.inbox.put(_Submission(list(prompt), config, generator, max_new_tokens, env, fut, on_start))
        return fut

    # ---- the driver thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self._busy())
                for cfg, lane in list(self.lanes.items()):
                    lane.engine.step()
                    self._count(cfg, lane)
                    self._collect(lane)
                self._drop_idle()
        except BaseException as e:  # noqa: BLE001 - fail every waiting caller instead of hanging them
            self.error = e
            for lane in self.lanes.values():
                for _, fut in lane.pending:
                    if not fut.done():
                        fut.set_exception(RuntimeError(f"the engine driver failed: {e!r}"))
            raise

    def _busy(self) -> bool:
        return any(not lane.idle for lane in self.lanes.values())

    def _drain(self, block: bool) -> None:
        """Move every queued submission into its lane's engine (waiting up to 0.1 s for one when idle)."""
        while True:
            try:
                sub = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if sub is None:
                return
            if not sub.future.set_running_or_notify_cancel():
                continue
            try:
                lane = self._lane(sub.config.replace(max_new_tokens=1))  # a length per sequence, not per lane
                seq = lane.engine.submit(sub.prompt, sub.generator, env=sub.env,
                                         max_new_tokens=sub.max_new or sub.config.max_new_tokens)
            except ValueError as e:
                sub.future.set_exception(e)
                continue
            lane.pending.append((seq, sub.future))
            if sub.on_start is not None:
                sub.on_start(seq, lane.engine)

    def _lane(self, config) -> _Lane:
        if config not in self.lanes:
            engine = Engine(self.model, config, max_batch=self.max_batch, canvas_len=self.max_len,
                            tokenizer=self.tokenizer, mt=self.mt)
            self.lanes[config] = _Lane(engine)
            self._counted[config] = (0, 0)
        return self.lanes[config]

    def _count(self, cfg, lane: _Lane) -> None:
        f0, r0 = self._counted[cfg]
        self.num_forwards += lane.engine.num_forwards - f0
        self.row_forwards += lane.engine.row_forwards - r0
        self._counted[cfg] = (lane.engine.num_forwards, lane.engine.row_forwards)

    def _collect(self, lane: _Lane) -> None:
        still = []
        for s, fut in lane.pending:
            if s.status == FINISHED:
                fut.set_result(s)
            else:
                still.append((s, fut))
        lane.pending = still
        if lane.idle:
            lane.engine.sequences.clear()  # nothing refers to them any more: a long-lived server must not grow

    def _drop_idle(self) -> None:
        idle = [cfg for cfg, lane in self.lanes.items() if lane.idle]
        for cfg in idle[: max(0, len(self.lanes) - self.max_lanes)]:
            del self.lanes[cfg]
            del self._counted[cfg]
