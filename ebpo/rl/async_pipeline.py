"""Asynchronous RL with bounded staleness: a producer thread collects steps ahead of the learner.

`trainer.max_staleness = s`: the rollouts (and rewards) of step j are generated with the weights the
learner had after step j - 1 - s (the initial weights for j <= s + 1) while the driver's main thread runs
the learner on earlier steps. The lag is fixed, not "whatever is newest", so a run is a deterministic
function of its seed: the same samples whatever the timing, a resumed run repeats the uninterrupted one,
and a rollout worker that dies mid-flight redoes exactly the samples it lost. A sample is therefore at
most s weight versions behind the learner that trains on it (exactly s once the run is past step s + 1
and every step updates; fewer when a step had no update). With s = 0 the producer waits for every update:
the synchronous loop, which `ebpo.rl.sync_loop` runs without this thread.

Thread safety: the producer owns the prompt sampler; rollout workers are reached under
`PolicyWeights.holding` (load a version, then generate); the learner is driven by the main thread only.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ebpo.rl.records import StepRecord
from ebpo.rl.weights import Weights


class PipelineStopped(RuntimeError):
    """The pipeline was stopped while a caller waited on it."""


class RolloutPipeline:
    """Collects steps `first..last` in order on a background thread; `get(j)` hands step j to the learner.

    collect(step, weights) -> the step's record (its `times` receive `timing_s/wait_learner`).
    weights: the weights after step `first - 1` (the learner's current ones). `ready`: records of steps
    already collected (restored in-flight steps of a checkpoint), `first` is then the step after them.
    """

    def __init__(self, collect: Callable[[int, Weights], StepRecord], first: int, last: int, max_staleness: int,
                 weights: Weights, ready: dict[int, StepRecord] | None = None):
        self.collect, self.last, self.s = collect, last, max_staleness
        self._cv = threading.Condition()
        self._ready: dict[int, StepRecord] = dict(ready or {})
        self._next = first
        done = first - 1 - len(self._ready)  # the last step the learner finished
        self._weights: dict[int, Weights] = {done: weights}  # step -> weights after it
        self._floor = done  # steps up to s + 1 after it use its weights
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ebpo-rollout-pipeline", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------------- producer
    def _source_step(self, step: int) -> int:
        """The step whose weights generate step `step`: a fixed lag of s + 1 steps."""
        return max(step - 1 - self.s, self._floor)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    step = self._next
                    if step > self.last or self._stop:
                        return
                    t0 = time.perf_counter()
                    while self._source_step(step) not in self._weights and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    weights, waited = self._weights[self._source_step(step)], time.perf_counter() - t0
                record = self.collect(step, weights)  # outside the lock: rollouts and rewards take seconds
                record.times["timing_s/wait_learner"] = waited
                with self._cv:
                    self._ready[step] = record
                    self._next = step + 1
                    self._cv.notify_all()
        except BaseException as err:  # noqa: BLE001 (handed to the main thread, which raises it)
            with self._cv:
                self._error = err
                self._cv.notify_all()

    # -------------------------------------------------------------------------------------- main thread
    def get(self, step: int) -> tuple[StepRecord, float]:
        """Wait for step `step`'s record; returns (record, seconds waited)."""
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._ready:
                self._raise_if_failed()
                self._cv.wait()
            return self._ready.pop(step), time.perf_counter() - t0

    def publish(self, step: int, weights: Weights) -> None:
        """The learner finished `step`; `weights` are its weights after it (steps s + 1 later use them)."""
        with self._cv:
            self._weights[step] = weights
            for old in [k for k in self._weights if k < step - self.s]:
                del self._weights[old]
            self._cv.notify_all()

    def in_flight(self, step: int) -> list[StepRecord]:
        """Records of steps step+1 .. step+s (at most `last`), waiting for them: a checkpoint after `step`
        stores them, so that a resumed run trains on exactly the samples the uninterrupted run used."""
        wanted = range(step + 1, min(step + self.s, self.last) + 1)
        with self._cv:
            while not all(j in self._ready for j in wanted):
                self._raise_if_failed()
                self._cv.wait()
            return [self._ready[j] for j in wanted]

    def stop(self) -> None:
        """Stop after the step being collected (its record is dropped); joins the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rollout pipeline failed: {self._error}") from self._error
        if not self._thread.is_alive():
            raise PipelineStopped("the rollout pipeline stopped before producing the step asked for")


def staleness_metrics(versions: list[int], learner_version: int) -> dict[str, Any]:
    """`async/staleness_{mean,max}` of the samples a learner at `learner_version` trains on (versions
    behind: 0 = on-policy)."""
    if not versions:
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    lag = [learner_version - v for v in versions]
    return {"async/staleness_mean": sum(lag) / len(lag), "async/staleness_max": float(max(lag))}
