"""Ray actors that come back: create, call with retry, and restart on death.

A rollout or reward actor can die (OOM kill, node loss, a crash in native code). `ResilientActor`
catches the death on the call, starts a fresh actor from a factory (which for rollout workers includes
the latest synced weights), retries the same work, and records the event; the run goes on.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

log = logging.getLogger("ebpo")

_DEATH = (RayActorError, ActorDiedError, ActorUnavailableError)


class ResilientActor:
    """Wraps one Ray actor handle built by `factory()`; `call` retries on actor death."""

    def __init__(self, name: str, factory: Callable[[], Any], max_retries: int = 3,
                 on_event: Callable[[str], None] | None = None):
        self.name = name
        self.factory = factory
        self.max_retries = max_retries
        self.restarts = 0
        self.on_event = on_event if on_event is not None else (lambda msg: log.warning(msg))  # an empty log is falsy
        self.handle = factory()

    def submit(self, method: str, *args, **kwargs):
        """Start a call; returns a (ref, method, args, kwargs) ticket for `result`."""
        return getattr(self.handle, method).remote(*args, **kwargs), method, args, kwargs

    def result(self, ticket, timeout: float | None = None):
        """Wait for a ticket; if the actor died, restart it and re-run the call (up to max_retries)."""
        ref, method, args, kwargs = ticket
        for attempt in range(self.max_retries + 1):
            try:
                return ray.get(ref, timeout=timeout)
            except _DEATH as err:
                if attempt == self.max_retries:
                    raise
                self.restart(f"{self.name} died during {method} ({type(err).__name__}); restarting and retrying")
                ref = getattr(self.handle, method).remote(*args, **kwargs)

    def call(self, method: str, *args, **kwargs):
        return self.result(self.submit(method, *args, **kwargs))

    def restart(self, reason: str) -> None:
        self.restarts += 1
        self.on_event(reason)
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # already gone
            pass
        time.sleep(0.1)
        self.handle = self.factory()


def split_evenly(items: list, parts: int) -> list[list]:
    """Contiguous, order-preserving split of `items` into `parts` chunks whose sizes differ by at most 1."""
    parts = max(1, min(parts, len(items))) if items else 1
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out
