"""The synchronous RL loop (trainer.max_staleness = 0): each step collects, updates, syncs, in that order.

    for step in start+1 .. last:
        record  = collect(run, step)           prompts -> rollouts -> rewards -> advantages (ebpo.rl.step)
        metrics = learn(run, record)           the learner update on the kept rows
        weights.sync()                         the new version into every rollout worker (ebpo.rl.weights)
        evaluate, log, checkpoint

Every sample is drawn with the learner's current weights, so the update is on-policy. A learner rank that
dies rebuilds the learner group from the latest checkpoint and the lost steps are redone; rollout and
reward actors restart themselves (ebpo.rl.cluster). The asynchronous loop is `ebpo.rl.async_loop`.
"""
from __future__ import annotations

import time

from ebpo.infra.plots import plot_run
from ebpo.rl import checkpoints
from ebpo.rl.config import RLConfig
from ebpo.rl.learner_group import LearnerRankDied
from ebpo.rl.run_state import RunReadout
from ebpo.rl.setup import RLRun, rebuild_learner, start_run
from ebpo.rl.step import (StepProgress, collect, evaluate, evaluates_at, finish, last_step, learn, saves_at,
                          timed)


class SyncLoop(RunReadout):
    """`SyncLoop(cfg).fit()` trains; `close()` releases the actors. `run` holds everything else."""

    def __init__(self, cfg: RLConfig, run: RLRun | None = None):
        self.run = run or start_run(cfg)
        if self.run.resumed:  # the rollout workers start from the initial policy: give them the restored one
            self.sync_weights(new_version=False)

    def sync_weights(self, new_version: bool = True) -> dict[str, float]:
        """Bring every rollout worker to the learner's weights (`PolicyWeights.sync`); sync/* metrics."""
        return self.run.weights.sync(new_version)

    def step(self, step: int) -> dict[str, float]:
        """One step: collect, update, sync; returns its metrics (evaluation and checkpoint are `fit`'s)."""
        run, t_step = self.run, time.perf_counter()
        record = collect(run, step)
        metrics = learn(run, record)
        if metrics:  # an update happened: its weights go to the rollout workers
            run.version_log.append((step, run.weights.version, [record.samples[i].weights_version
                                                                 for i in record.kept()]))
            with timed(record.times, "sync"):
                metrics.update(self.sync_weights())
        return finish(run, record, metrics, t_step)

    def fit(self) -> list[dict]:
        """Steps from the start (or the checkpoint) to trainer.steps (or trainer.stop_after); per-step metrics."""
        run = self.run
        history: list[dict] = []
        if run.start_step == 0 and run.eval_rows:
            run.tracker.log(evaluate(run), step=0)
        last = last_step(run)
        with StepProgress(run) as progress:
            step = run.start_step
            while step < last:
                step += 1
                try:
                    metrics = self.step(step)
                except LearnerRankDied as err:
                    step = rebuild_learner(run, err)
                    self.sync_weights(new_version=False)
                    history = [h for h in history if h["step"] <= step]  # the lost steps are redone
                    progress.back_to(step)
                    continue
                if evaluates_at(run, step):
                    metrics.update(evaluate(run))
                run.tracker.log(metrics, step=step)
                history.append({"step": step, **metrics})
                progress.done(metrics)
                if saves_at(run, step, last):
                    checkpoints.save(run, step, run.sampler.state())
        return history

    def close(self) -> None:
        """Plots, W&B finish, then the actors and the placement group are released (the Ray instance stays)."""
        self.run.close(plot_run if self.run.cfg.trainer.plots else None)
