"""The asynchronous RL loop (trainer.max_staleness = s > 0): rollouts run ahead of the learner.

    producer thread (ebpo.rl.async_pipeline):  step j = collect(run, j, weights after step j - 1 - s)
    main thread, for step in start+1 .. last:
        record  = pipeline.get(step)           waits for the producer when it is behind
        metrics = learn(run, record)           decoupled off-policy loss on rows up to s versions old
        pipeline.publish(step, weights.publish())   the new version into the object store, bucketed
        evaluate (with the newest version), log, checkpoint (with the steps collected ahead)

Weight versions live in `ebpo.rl.weights.PolicyWeights`; the rollout workers load the version a step
asks for when it starts (`PolicyWeights.holding`). The lag is fixed, so a run is a deterministic function
of its seed and a resumed run repeats the uninterrupted one. The synchronous loop is `ebpo.rl.sync_loop`.
"""
from __future__ import annotations

import time

from ebpo.infra.plots import plot_run
from ebpo.rl import checkpoints
from ebpo.rl.async_pipeline import RolloutPipeline, staleness_metrics
from ebpo.rl.config import RLConfig
from ebpo.rl.learner_group import LearnerRankDied
from ebpo.rl.run_state import RunReadout
from ebpo.rl.setup import RLRun, rebuild_learner, start_run
from ebpo.rl.step import StepProgress, collect, evaluate, evaluates_at, finish, last_step, learn, saves_at, timed


class AsyncLoop(RunReadout):
    """`AsyncLoop(cfg).fit()` trains; `close()` stops the producer and releases the actors."""

    def __init__(self, cfg: RLConfig, run: RLRun | None = None):
        self.run = run or start_run(cfg)
        self.pipeline: RolloutPipeline | None = None
        self.sampler_after: dict | None = None  # the sampler after the last step the learner took
        self._unpublished = None  # (step, weights) not handed to the producer yet

    def _start_pipeline(self) -> None:
        """Collect steps ahead of the learner; in-flight steps of a restored checkpoint are handed over first."""
        run, tc = self.run, self.run.cfg.trainer
        ready = {r.step: r for r in run.in_flight}
        self.pipeline = RolloutPipeline(lambda step, weights: collect(run, step, weights),
                                        run.start_step + 1 + len(ready), tc.steps, tc.max_staleness,
                                        run.weights.current(), ready)
        run.in_flight = []

    def _stop_pipeline(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None

    def step(self, step: int) -> dict[str, float]:
        """The learner's side of one step: wait for its record, update, publish the new version."""
        run, t_step = self.run, time.perf_counter()
        record, waited = self.pipeline.get(step)
        record.times["timing_s/wait_rollout"] = waited  # the learner's wait for this step's samples
        self.sampler_after = record.sampler_after
        versions = [record.samples[i].weights_version for i in record.kept()]
        stale = staleness_metrics(versions, run.weights.version) if versions else {}
        metrics = learn(run, record)
        if metrics:  # an update happened: its weights become the next version
            run.version_log.append((step, run.weights.version, versions))
            metrics.update(stale)
            with timed(record.times, "sync"):
                run.weights.publish()
        self._unpublished = (step, run.weights.published)  # rollouts of step + 1 + s use them (`_publish`)
        return finish(run, record, metrics, t_step)

    def _publish(self) -> None:
        """Hand the newest weights to the producer. On a checkpoint step this waits until the checkpoint is
        written: the producer cannot start a step beyond the saved in-flight ones meanwhile, so the rollout
        workers' carried sequences (partial rollouts) are saved as of the last saved record."""
        if self._unpublished is not None:
            self.pipeline.publish(*self._unpublished)
            self._unpublished = None

    def fit(self) -> list[dict]:
        """Steps from the start (or the checkpoint) to trainer.steps (or trainer.stop_after); per-step metrics."""
        run = self.run
        history: list[dict] = []
        if run.start_step == 0 and run.eval_rows:
            run.tracker.log(evaluate(run, run.weights.published), step=0)
        self._start_pipeline()
        last = last_step(run)
        with StepProgress(run) as progress:
            step = run.start_step
            while step < last:
                step += 1
                try:
                    metrics = self.step(step)
                    if not saves_at(run, step, last):
                        self._publish()
                except LearnerRankDied as err:
                    self._unpublished = None
                    self._stop_pipeline()
                    step = rebuild_learner(run, err)
                    self._start_pipeline()
                    history = [h for h in history if h["step"] <= step]  # the lost steps are redone
                    progress.back_to(step)
                    continue
                if evaluates_at(run, step):
                    metrics.update(evaluate(run, run.weights.published))
                run.tracker.log(metrics, step=step)
                history.append({"step": step, **metrics})
                progress.done(metrics)
                if saves_at(run, step, last):
                    # the steps collected ahead are saved; the sampler stands after the last of them
                    in_flight = self.pipeline.in_flight(step)
                    sampler = (in_flight[-1].sampler_after if in_flight else self.sampler_after)
                    checkpoints.save(run, step, sampler, in_flight)
                    self._publish()
        self._stop_pipeline()
        return history

    def close(self) -> None:
        """Stop the producer; plots, W&B finish, then the actors are released (the Ray instance stays)."""
        self._stop_pipeline()
        self.run.close(plot_run if self.run.cfg.trainer.plots else None)
