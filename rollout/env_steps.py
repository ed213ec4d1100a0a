"""`env.step` calls of multi-turn rollouts, run beside the decoder, never blocking the process's exit.

Each call runs in its own daemon thread (at most `max_workers` inside `env.step` at once). A step that hangs
past its timeout is abandoned: the trajectory fails, and the thread, being a daemon, cannot keep the
interpreter alive after the caller is done (a `ThreadPoolExecutor` joins its workers at exit, so one hung
tool used to keep `ebpo eval --env` running forever after it had printed its results).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time


class StepRunner:
    """Submits `env.step(text)` calls; each returns a Future of ((observation, reward, done, info) value,
    seconds the call took)."""

    def __init__(self, max_workers: int):
        self._slots = threading.BoundedSemaphore(max(1, int(max_workers)))

    def submit(self, env, text: str) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            with self._slots:
                if not fut.set_running_or_notify_cancel():
                    return
                t0 = time.monotonic()
                try:
                    out = env.step(text)
                except BaseException as e:  # noqa: BLE001 - the failure belongs to this trajectory only
                    fut.set_exception(e)
                    return
                fut.set_result((out, time.monotonic() - t0))

        threading.Thread(target=run, name="ebpo-env-step", daemon=True).start()
        return fut


def unpack_step(value):
    """(observation, reward, done, info) from a StepResult, a 4-tuple or a dict; TypeError otherwise."""
    if isinstance(value, dict):
        value = (value.get("observation"), value.get("reward", 0.0), value.get("done"), value.get("info") or {})
    obs, reward, done, info = value
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"observation must be str or None, got {type(obs).__name__}")
    if not isinstance(info, dict):
        raise TypeError(f"info must be a dict, got {type(info).__name__}")
    return obs, float(reward or 0.0), bool(done), info
