"""A pool of reward worker processes with a hard per-call timeout enforced from outside.

Each worker is a spawned (or forkserver) process that loads reward functions by reference and calls
them on its main thread (so math-verify's ``signal.alarm`` works). The dispatcher in the parent sends
one call per idle worker and waits on the pipes; a call past its deadline gets its worker SIGKILLed and
replaced, a worker that dies is replaced, and neither delays the calls running on other workers.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any

from rewards.api import normalize
from rewards.loader import call_batched, call_reward, load_reward


@dataclasses.dataclass
class Call:
    """One reward call. ``payload``: the fields dict, or for batched rewards the list of samples."""

    ref: str
    kwargs: dict
    payload: Any
    batched: bool = False


@dataclasses.dataclass
class Outcome:
    """status: "ok" (value = (score|None, extras) or a list of them), "timeout" or "error" (message)."""

    status: str
    value: Any = None
    message: str = ""
    seconds: float = 0.0


def execute(call: Call, cache: dict) -> Outcome:
    """Run one call in this process (used by workers and by the in-process mode)."""
    t0 = time.perf_counter()
    try:
        fn = cache.get(call.ref)
        if fn is None:
            fn = cache[call.ref] = load_reward(call.ref)
        if call.batched:
            outs = call_batched(fn, call.payload, call.kwargs)
            value = [normalize(o, f"reward {call.ref!r}") for o in outs]
        else:
            value = normalize(call_reward(fn, call.payload, call.kwargs), f"reward {call.ref!r}")
        return Outcome("ok", value, seconds=time.perf_counter() - t0)
    except BaseException as e:  # a user's reward may raise anything, SystemExit included
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return Outcome("error", None, tb[:500], time.perf_counter() - t0)


def _worker_main(conn, preload: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    cache: dict = {}
    for ref in preload:  # import before reporting ready, so import time never counts as call time
        try:
            cache[ref] = load_reward(ref)
        except Exception:
            pass  # reported on the first call of that reward
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, call = msg
        out = execute(call, cache)
        try:
            conn.send((task_id, out))
        except Exception as e:  # unpicklable extras
            conn.send((task_id, Outcome("error", None, f"result not picklable: {e}"[:500], out.seconds)))


class _Worker:
    def __init__(self, ctx, preload):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, preload), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def start_failure(i: int, exitcode, method: str) -> str:
    """Why a worker process died before it was ready, in words (the usual cause: a main script without
    the ``if __name__ == "__main__":`` guard, which every spawned worker re-imports and re-runs)."""
    msg = (f"reward worker {i} exited with code {exitcode} before it was ready (mp_context={method!r}); "
           "its traceback, if any, is on stderr above.")
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if method in ("spawn", "forkserver") and path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                guarded = "__main__" in f.read()
        except OSError:
            guarded = True
        if not guarded:
            return (f"{msg} The main script {path} has no `if __name__ == \"__main__\":` guard: each worker "
                    "process re-imports it and runs its module-level code again (creating another RewardWorker "
                    "there fails). Put the script's work under that guard.")
    return (f"{msg} With mp_context={method!r} each worker re-imports the main module: a script that creates "
            "a RewardWorker at module level needs an `if __name__ == \"__main__\":` guard.")


class HardTimeoutPool:
    """``num_workers`` processes; ``run(calls)`` returns one Outcome per call, in order."""

    def __init__(self, num_workers: int, timeout_s: float, mp_context: str = "spawn",
                 preload: list[str] | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.ctx = mp.get_context(mp_context)
        self.timeout_s = float(timeout_s)
        self.preload = list(preload or [])
        self.workers = [_Worker(self.ctx, self.preload) for _ in range(num_workers)]
        self.restarts = 0

    def _replace(self, i: int) -> None:
        self.workers[i].kill()
        self.workers[i] = _Worker(self.ctx, self.preload)
        self.restarts += 1

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker has started (imports done); raise RuntimeError with the reason when
        one exits first or does not start in time."""
        end = time.monotonic() + timeout_s
        for i, w in enumerate(self.workers):
            while not w.ready:
                if not wait([w.conn, w.proc.sentinel], timeout=max(0.0, end - time.monotonic())):
                    raise RuntimeError(f"reward worker {i} did not start within {timeout_s:.0f}s")
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    w.proc.join(5)
                    raise RuntimeError(start_failure(i, w.proc.exitcode, self.ctx.get_start_method())) from None
                w.ready = msg[0] == "ready"

    def _receive(self, i: int, results: list | None) -> None:
        w = self.workers[i]
        try:
            task_id, out = w.conn.recv()
        except (EOFError, OSError):
            if w.task is not None and results is not None:
                results[w.task] = Outcome("error", None, f"reward worker died (exit code {w.proc.exitcode})")
            self._replace(i)
            return
        if task_id == "ready":
            w.ready = True
        elif w.task == task_id and results is not None:
            results[task_id], w.task = out, None

    def run(self, calls: list[Call]) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(calls)
        queue = collections.deque(range(len(calls)))
        while queue or any(w.task is not None for w in self.workers):
            for w in self.workers:
                if queue and w.ready and w.task is None:
                    w.task = queue.popleft()
                    w.deadline = time.monotonic() + self.timeout_s
                    w.conn.send((w.task, calls[w.task]))
            busy = [w.deadline for w in self.workers if w.task is not None]
            wait_s = max(0.0, min(busy) - time.monotonic()) if busy else None
            handles = {}
            for i, w in enumerate(self.workers):
                handles[w.conn] = i
                handles[w.proc.sentinel] = i
            for h in wait(list(handles), timeout=wait_s):
                i = handles[h]
                w = self.workers[i]
                if h is w.conn and w.conn.poll():
                    self._receive(i, results)
                elif h is w.proc.sentinel and not w.conn.poll():
                    if w.task is not None:
                        results[w.task] = Outcome("error", None, f"reward worker died (exit code {w.proc.exitcode})")
                    self._replace(i)
            now = time.monotonic()
            for i, w in enumerate(self.workers):
                if w.task is not None and now >= w.deadline and results[w.task] is None:
                    results[w.task] = Outcome("timeout", None, f"no result within {self.timeout_s:g}s",
                                              self.timeout_s)
                    self._replace(i)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self.workers:
            w.proc.join(1)
            w.kill()
        self.workers = []
