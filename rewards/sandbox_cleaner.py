"""Clean-up that did not fit in a sample's budget, finished in the background.

A candidate can leave more on the host than can be removed within its sample's wall-time budget (an
inode flood takes about as long to delete as to make). The sample then returns on time, and what is
left is handed here: one daemon thread per process works through it, a bounded slice at a time, and
calls each job's ``done`` when it is finished (for a sandbox uid: marks it free and releases its lock,
so no other sample can draw the uid before that). A daemon thread never holds the process at exit; a
job cut off that way leaves its uid marked busy, and the next holder cleans it first.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

_LOG = logging.getLogger("rewards.sandbox")
SLICE_S = 2.0       # seconds of one step of a job before the next job gets its turn
MAX_STEPS = 1000    # a job that never finishes is given up (its uid stays busy; see sandbox_uids)

_JOBS: queue.Queue = queue.Queue()
_IDLE = threading.Condition()
_STATE = {"thread": None, "pending": 0}


def submit(step: Callable[[float], bool], done: Callable[[bool], None]) -> None:
    """Run ``step(deadline)`` (``time.monotonic()`` seconds; True when finished) until it finishes or
    MAX_STEPS steps, then ``done(finished)``."""
    with _IDLE:
        _STATE["pending"] += 1
        if _STATE["thread"] is None or not _STATE["thread"].is_alive():
            _STATE["thread"] = threading.Thread(target=_work, name="ebpo-sandbox-cleaner", daemon=True)
            _STATE["thread"].start()
    _JOBS.put((step, done, 0))


def _work() -> None:
    while True:
        step, done, n = _JOBS.get()
        try:
            finished = bool(step(time.monotonic() + SLICE_S))
        except Exception:  # a failed step is an unfinished one: retried, never taken for done
            finished = False
        if not finished and n + 1 < MAX_STEPS:
            _JOBS.put((step, done, n + 1))
            time.sleep(0.01 if _JOBS.qsize() > 1 else 0.05)
            continue
        if not finished:
            _LOG.warning("code reward: a sandbox clean-up did not finish after %d steps; given up", n + 1)
        try:
            done(finished)
        except Exception:
            _LOG.exception("code reward: sandbox clean-up callback failed")
        with _IDLE:
            _STATE["pending"] -= 1
            _IDLE.notify_all()


def pending() -> int:
    """Clean-up jobs not finished yet."""
    with _IDLE:
        return _STATE["pending"]


def wait_idle(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds until every job is finished; True when none is left."""
    end = time.monotonic() + timeout_s
    with _IDLE:
        while _STATE["pending"]:
            left = end - time.monotonic()
            if left <= 0:
                return False
            _IDLE.wait(left)
        return True
