"""`RLRun`: what both RL loops share (configuration, data, actors, weight versions, tracking), built by
`ebpo.rl.setup` and read by the step functions, the loops and the checkpoints. A module of its own so that those
modules all import it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ebpo.infra.tracking import Tracker
from ebpo.rl.cluster import Cluster, EventLog
from ebpo.rl.config import RLConfig
from ebpo.rl.prompts import PromptSampler, Prompts
from ebpo.rl.records import StepRecord
from ebpo.rl.weights import PolicyWeights


@dataclass
class RLRun:
    """What both RL loops share: the configuration, the data, the actors, the weight versions, tracking.

    start_step: the last step done (0 for a new run, the checkpoint's step after a resume); in_flight:
    records of steps the asynchronous loop had collected ahead when the checkpoint was written;
    version_log: (step, learner version, each trained sample's weight version) per update."""
    cfg: RLConfig
    run_dir: Path
    tokenizer: Any
    prompts: Prompts
    train_rows: list[dict]
    eval_rows: list[dict]
    sampler: PromptSampler
    reward_specs: list[tuple]
    reward_names: list[str]
    judge_names: list[str]
    events: EventLog
    model_spec: str = ""
    block_size: int = 0  # the learner's (= the sampler's) block size
    cluster: Cluster = None
    weights: PolicyWeights = None
    tracker: Tracker = None
    start_step: int = 0
    resumed: bool = False
    in_flight: list[StepRecord] = field(default_factory=list)
    version_log: list[tuple[int, int, list[int]]] = field(default_factory=list)
    partial: Any = None  # ebpo.rl.partial_collect.PartialLedger with trainer.partial_rollouts
    # collect(run, step, weights) -> StepRecord: the rollout path, chosen once at start-up (ebpo.rl.setup): the
    # synchronous collection of ebpo.rl.step, or partial rollouts' (ebpo.rl.partial_collect)
    collector: Any = None

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def learner(self):
        """The learner group (rebuilt when a rank dies, so always read it here)."""
        return self.cluster.learner

    def close(self, plot) -> None:
        """Plots (`plot(run_dir)`, or None), W&B finish, then the actors (the Ray instance stays)."""
        try:
            if plot is not None:
                plot(self.run_dir)
            self.tracker.finish()
        finally:
            self.cluster.stop()


class RunReadout:
    """What tests and tools read of a run through its loop (`SyncLoop`, `AsyncLoop`), whose `run` is an `RLRun`."""

    run: RLRun

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir

    @property
    def events(self) -> list[str]:
        return self.run.events

    @property
    def learner(self):
        return self.run.learner

    @property
    def version_log(self) -> list[tuple[int, int, list[int]]]:
        return self.run.version_log
