"""`EngineDriver`: one thread that owns the server's one rollout engine and feeds it from many callers.

Callers (HTTP request handlers, the agent gateway) call `submit(...)` from any thread and get a
`concurrent.futures.Future` of the finished `rollout.sequence.Sequence`. Only the driver thread touches the
engine: it moves submissions (and aborts) from a thread-safe inbox into the engine between two `Engine.step`
calls, so a request that arrives while a batch is decoding joins it at the next forward (continuous batching),
and the engine itself needs no lock.

Every request's `DecodeConfig` travels with its sequences: requests with different temperatures, presets or
thresholds share the same forwards (`rollout.lifecycle.settings_for` says what must match: the block size, the cache and
the compiled step). A sequence's tokens depend only on its prompt, generator, settings and the weights
(`rollout.engine`), never on what else is in the batch. The engine lives as long as the driver.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass

import torch

from rollout.config import DecodeConfig
from rollout.engine import Engine
from rollout.multiturn import TurnDriver
from rollout.sequence import DECODING, FINISHED


@dataclass
class _Submission:
    prompt: list[int]
    config: object  # DecodeConfig
    generator: torch.Generator | None
    max_new: int | None
    env: object | None
    future: concurrent.futures.Future
    on_start: object | None = None
    on_block: object | None = None


@dataclass
class _Abort:
    future: concurrent.futures.Future


class EngineDriver:
    """Runs one engine of `model` in a daemon thread (`start()`; `close()` stops it).

    max_batch: most sequences decoding at once; max_len: the canvas length of every sequence (prompt + generated
    tokens, + observations for multi-turn), rounded up to whole blocks; mt: a `rollout.multiturn.MultiTurnConfig`
    for sequences that carry an environment (the agent gateway), None for single-turn serving; engine_config: the
    engine's own `DecodeConfig` (block size, prefix cache, compiled step; the default settings of a submission
    without one). Counters (read from any thread): num_forwards (model calls), row_forwards (rows in them).
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 16, max_len: int = 1024, mt=None,
                 engine_config: DecodeConfig | None = None):
        self.model, self.tokenizer, self.mt = model, tokenizer, mt
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        self.engine = Engine(model, engine_config or DecodeConfig(), max_batch=self.max_batch, canvas_len=self.max_len)
        # sequences with an environment (the agent gateway's episodes) go through the multi-turn client
        self.turns = TurnDriver(tokenizer=tokenizer, mt=mt, engine=self.engine) if mt is not None else None
        self.pending: dict = {}  # Future -> Sequence not finished yet
        self.watched: dict = {}  # Future -> [on_block, generated tokens already reported] (streamed sequences)
        self.inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def num_forwards(self) -> int:
        return self.engine.num_forwards

    @property
    def row_forwards(self) -> int:
        return self.engine.row_forwards

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
               max_new_tokens: int | None = None, env=None, on_start=None,
               on_block=None) -> concurrent.futures.Future:
        """Queue one sequence (token ids, its `DecodeConfig`, its own generator when sampling, a single-turn
        length, an environment for a multi-turn sequence); the Future gives the finished `Sequence` (or the
        ValueError the engine raised: a prompt too long for the canvas, settings the engine cannot decode with,
        such as DELETE / INSERT without their token ids or another block size). on_start(sequence, driver)
        is called in the driver thread once the engine holds the sequence (the agent gateway reads a waiting
        turn's token ids from the engine's slot through it). on_block(sequence, tokens), for a single-turn
        sequence, is called in the driver thread after each engine step in which the sequence's committed
        blocks grew, with its generated tokens up to the start of its active block (`committed_tokens`); the
        last blocks come with the finished Sequence instead. It must be quick and must not raise (the server
        hands the tokens to its event loop)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"the engine driver stopped: {self.error!r}"))
            return fut
        self.inbox.put(_Submission(list(prompt), config, generator, max_new_tokens, env, fut, on_start, on_block))
        return fut

    def abort(self, future: concurrent.futures.Future) -> None:
        """Stop the sequence behind `future` (a client that went away): it leaves the engine before the next
        forward, frees its slot, and `future.result()` raises `concurrent.futures.CancelledError`.
        Safe from any thread; a finished or unknown future is left alone."""
        if future.cancel():  # not picked up by the driver yet: it will skip the submission
            return
        self.inbox.put(_Abort(future))

    # ---- the driver thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self._busy())
                if self.turns is not None:
                    self.turns.step()
                else:
                    self.engine.step()
                self._report_blocks()
                self._collect()
        except BaseException as e:  # noqa: BLE001 - fail every waiting caller instead of hanging them
            self.error = e
            for fut in self.pending:
                if not fut.done():
                    fut.set_exception(RuntimeError(f"the engine driver failed: {e!r}"))
            raise

    def _busy(self) -> bool:
        return bool(self.pending) or bool(self.engine.queue) or bool(self.engine.active)

    def _drain(self, block: bool) -> None:
        """Move every queued submission into the engine and apply aborts (waiting up to 0.1 s when idle)."""
        while True:
            try:
                sub = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if sub is None:
                return
            if isinstance(sub, _Abort):
                self._abort(sub.future)
                continue
            if not sub.future.set_running_or_notify_cancel():
                continue
            try:
                if sub.env is not None:
                    seq = self.turns.submit(sub.prompt, sub.generator, env=sub.env)
                else:
                    seq = self.engine.submit(sub.prompt, sub.generator, max_new_tokens=sub.max_new, config=sub.config)
            except ValueError as e:
                sub.future.set_exception(e)
                continue
            self.pending[sub.future] = seq
            if sub.on_block is not None and sub.env is None:
                self.watched[sub.future] = [sub.on_block, 0]
            if sub.on_start is not None:
                sub.on_start(seq, self)

    def _abort(self, fut: concurrent.futures.Future) -> None:
        seq = self.pending.pop(fut, None)
        self.watched.pop(fut, None)
        if seq is None:
            return
        self.engine.abort(seq)
        if not fut.done():  # a running Future cannot be cancel()led; its result() raises CancelledError all the same
            fut.set_exception(concurrent.futures.CancelledError("aborted by the caller"))
        self.engine.forget_finished()

    def committed_tokens(self, s) -> list[int] | None:
        """The generated tokens of a live single-turn sequence `s` that no later forward can change, or None while
        it is not decoding a block (queued, or in a Multi-Block Editing pass). Blocks commit in order, so those
        before its active block are final, except that with Multi-Block Editing (`mbe_window` w > 0) the window
        opened when the active block ends reaches back w blocks: only blocks before `block - w` are final.
        Driver thread only."""
        if s.status != DECODING or s.slot is None or s.mbe_start is not None:
            return None
        end = min((s.block - max(0, s.cfg.mbe_window)) * self.engine.K, s.prompt_len + s.max_new)
        return self.engine.runner.read(s, s.prompt_len, end) if end > s.prompt_len else []

    def _report_blocks(self) -> None:
        for fut, watch in list(self.watched.items()):
            s = self.pending.get(fut)
            if s is None or s.status == FINISHED:
                continue
            toks = self.committed_tokens(s)
            if toks is not None and len(toks) > watch[1]:
                watch[1] = len(toks)
                watch[0](s, toks)

    def _collect(self) -> None:
        for fut, s in list(self.pending.items()):
            if s.status == FINISHED:
                del self.pending[fut]
                self.watched.pop(fut, None)
                fut.set_result(s)
        self.engine.forget_finished()  # nothing refers to them any more: a long-lived server must not grow
