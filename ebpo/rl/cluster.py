"""The RL run's actors: placement, start, calls spread over them, and stop (systems code, no algorithm).

`Cluster.start` starts `rollout.num_workers` rollout workers, `reward.num_actors` reward actors and a
learner group of `learner.num_workers` ranks, as Ray actors placed by `ray.colocate` / `ray.spread_nodes`.
Rollout and reward actors are `ResilientActor`s: one that dies is restarted (a rollout worker with the
weights `PolicyWeights.restart_weights` names) and its share of the call is retried. The learner group
is rebuilt whole (`new_learner`) when a rank dies. Ray itself is imported here, where the actors start:
the rest of the driver never touches it.

A rollout worker with `rollout.tensor_parallel` or `rollout.expert_parallel` > 1 is one `ParallelRolloutWorker`
actor that starts its `max(tp, ep)` ranks itself (docs/parallel.md), so the driver still sees one worker. It
holds the GPUs of all its ranks (`ray.rollout_gpus` is per rank) and, on CPU, shares `rollout.num_threads` among
its ranks, so that a worker uses the same cores whatever its layout.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import asdict
from typing import Callable, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from rewards import RewardWorker
from rewards.envs import make_environment
from rollout.parallel_worker import ParallelRolloutWorker
from rollout.worker import RolloutWorker

from ebpo.rl.actors import ResilientActor, split_evenly
from ebpo.rl.config import RLConfig
from ebpo.rl.learner_actor import LearnerActor
from ebpo.rl.learner_group import LearnerGroup
from ebpo.rl.records import RolloutSample
from ebpo.serve.agents import AgentRolloutWorker

log = logging.getLogger("ebpo")


def rollout_ranks(cfg: RLConfig) -> int:
    """Processes (and, on GPU, devices) of one rollout worker: max(tensor_parallel, expert_parallel)."""
    return max(cfg.rollout.tensor_parallel, cfg.rollout.expert_parallel)


def rollout_worker_class(cfg: RLConfig) -> tuple:
    """(Ray actor class of a rollout worker, its keyword arguments beyond model, decode, fp8, device, env and
    weights): a plain `RolloutWorker` (or the agent worker) holding `ray.rollout_gpus`, or, for a parallel layout,
    a `ParallelRolloutWorker` holding that many GPUs per rank. Its CPU reservation is 0 either way (its cores are
    `rollout.num_threads`, all CPUs when null), and a parallel worker's ranks share those threads."""
    ranks = rollout_ranks(cfg)
    threads = max(1, (cfg.rollout.num_threads or os.cpu_count() or 1) // ranks)
    if ranks > 1:
        return (ray.remote(num_cpus=0, num_gpus=cfg.ray.rollout_gpus * ranks)(ParallelRolloutWorker),
                {"num_threads": threads, "tensor_parallel": cfg.rollout.tensor_parallel,
                 "expert_parallel": cfg.rollout.expert_parallel})
    cls = AgentRolloutWorker if cfg.env.agent else RolloutWorker
    return ray.remote(num_cpus=0, num_gpus=cfg.ray.rollout_gpus)(cls), {"num_threads": threads}


class EventLog(list):
    """The run's notable events (restarts, fallbacks), one line each; also logged as warnings."""

    def __call__(self, message: str) -> None:
        log.warning(message)
        self.append(message)


class Cluster:
    """The actors of one RL run. `restart_weights()` -> keyword arguments (`weights`, `weights_version`)
    of a (re)started rollout worker; `event(line)` records a restart."""

    def __init__(self, cfg: RLConfig, model_spec: str, reward_specs: list[tuple], event: Callable[[str], None]):
        self.cfg, self.model_spec, self.reward_specs, self.event = cfg, model_spec, reward_specs, event
        self.rollout_workers: list[ResilientActor] = []
        self.reward_workers: list[ResilientActor] = []
        self.learner: Optional[LearnerGroup] = None
        self.learner_restarts = 0
        self.placement_group = None

    # ------------------------------------------------------------------------------------------ start / stop
    def start(self, restart_weights: Callable[[], dict]) -> None:
        """Start every actor (the learner ranks last: they load the model and form their group)."""
        cfg = self.cfg
        decode = {"preset": cfg.rollout.preset, **cfg.rollout.decode}
        rollout_cls, worker_kwargs = rollout_worker_class(cfg)
        reward_cls = ray.remote(num_cpus=cfg.ray.reward_cpus)(RewardWorker)
        self._placement = self._place()
        env = {}
        if cfg.env.agent:  # agent RL: the worker runs the agent function through its in-process gateway
            env = {"agent": cfg.env.agent, "agent_kwargs": dict(cfg.env.kwargs), "multiturn": asdict(cfg.env.turns)}
        elif cfg.env.multi_turn:  # the worker builds one environment per trajectory (rollout never imports rewards)
            env = {"env_factory": functools.partial(make_environment, cfg.env.name, dict(cfg.env.kwargs)),
                   "multiturn": asdict(cfg.env.turns)}

        def rollout_factory(i: int):
            return rollout_cls.options(**self._placement(i)).remote(
                self.model_spec, decode, fp8=cfg.rollout.fp8, device="cuda" if cfg.ray.rollout_gpus > 0 else "cpu",
                **worker_kwargs, **env, **restart_weights())

        def reward_factory():
            return reward_cls.remote(self.reward_specs, num_workers=cfg.reward.num_workers,
                                     timeout_s=cfg.reward.timeout_s, default_score=cfg.reward.default_score)

        retries = cfg.trainer.max_retries
        self.rollout_workers = [ResilientActor(f"rollout-{i}", functools.partial(rollout_factory, i), retries,
                                               self.event) for i in range(cfg.rollout.num_workers)]
        self.reward_workers = [ResilientActor(f"reward-{i}", reward_factory, retries, self.event)
                               for i in range(cfg.reward.num_actors)]
        self.learner = self._learner_group()

    def _learner_group(self) -> LearnerGroup:
        cfg = self.cfg
        learner_cls = ray.remote(num_cpus=0, num_gpus=cfg.ray.learner_gpus)(LearnerActor)
        return LearnerGroup(ray, lambda rank: learner_cls.options(**self._placement(cfg.rollout.num_workers + rank)).remote(
            self.model_spec, cfg.learner, cfg.rollout.num_threads, rank=rank), cfg.learner.num_workers)

    def new_learner(self, err: Exception) -> LearnerGroup:
        """A learner rank died: kill the group and start a new one (counted in faults/restarts); gives up
        after trainer.max_retries rebuilds."""
        self.learner_restarts += 1
        if self.learner_restarts > self.cfg.trainer.max_retries:
            raise RuntimeError(f"learner: {self.learner_restarts - 1} rebuilds already; giving up") from err
        self.event(f"{err}; rebuilding the learner group from the latest checkpoint")
        self.learner.kill()
        self.learner = self._learner_group()
        return self.learner

    def restarts(self) -> int:
        """Actor restarts so far (rollout and reward actors, learner rebuilds): `faults/restarts`."""
        return sum(w.restarts for w in self.rollout_workers + self.reward_workers) + self.learner_restarts

    def _place(self) -> Callable[[int], dict]:
        """index -> actor options for rollout worker i (0..n-1) and learner rank r (index n + r).

        `ray.colocate`: one STRICT_PACK placement group with a bundle per actor, so they share a node (and its
        GPUs); a restarted rollout worker returns to its own bundle. `ray.spread_nodes = m`: one bundle per
        node (STRICT_SPREAD) holding rollout workers i = j mod m and learner ranks r = j mod m. Otherwise Ray's
        default scheduler places each actor."""
        cfg = self.cfg
        if not cfg.ray.colocate and cfg.ray.spread_nodes <= 0:
            return lambda i: {}
        n_rollout, n_learner = cfg.rollout.num_workers, cfg.learner.num_workers
        gpus = [cfg.ray.rollout_gpus * rollout_ranks(cfg)] * n_rollout + [cfg.ray.learner_gpus] * n_learner

        def bundle(members: list[int]) -> dict:
            total = sum(gpus[i] for i in members)
            return {"CPU": float(len(members)), **({"GPU": total} if total > 0 else {})}

        if cfg.ray.colocate:
            slot_of = list(range(n_rollout + n_learner))
            strategy, what = "STRICT_PACK", "on one node"
        else:
            m = cfg.ray.spread_nodes
            slot_of = [i % m for i in range(n_rollout)] + [r % m for r in range(n_learner)]
            strategy, what = "STRICT_SPREAD", f"on {m} different nodes"
        bundles = [bundle([i for i, s in enumerate(slot_of) if s == j]) for j in range(max(slot_of) + 1)]
        self.placement_group = placement_group(bundles, strategy=strategy, name=f"{cfg.name}-policy")
        if not self.placement_group.wait(timeout_seconds=120):
            key = "ray.colocate" if cfg.ray.colocate else "ray.spread_nodes"
            raise RuntimeError(f"{key}: the cluster cannot place {bundles} {what} within 120 s; lower "
                               f"ray.rollout_gpus / ray.learner_gpus or change {key}")
        return lambda i: {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=slot_of[i])}

    def stop(self) -> None:
        """Release every actor and the placement group (the Ray instance stays)."""
        try:  # reward actors own worker processes: close them before the actor goes
            ray.get([w.handle.close.remote() for w in self.reward_workers], timeout=30)
        except Exception:  # noqa: BLE001 (an actor that is already gone needs no closing)
            pass
        if self.learner is not None:
            self.learner.kill()
        for handle in [w.handle for w in self.rollout_workers + self.reward_workers]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    # ------------------------------------------------------------------------------------------ calls
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], decode: dict | None = None,
                 rows: list[dict] | None = None) -> list[RolloutSample]:
        """Spread prompts over the rollout workers, in order; a dead worker is restarted and its share retried.
        `rows` (one dataset row per prompt): multi-turn rollouts against `env.name`. The caller holds
        `PolicyWeights.holding` so that no other version is loaded meanwhile."""
        items = list(zip(prompt_ids, seeds, rows if rows is not None else [None] * len(prompt_ids)))
        chunks = split_evenly(items, len(self.rollout_workers))
        tickets = [w.submit("generate", [p for p, _, _ in c], [s for _, s, _ in c], decode,
                            [r for _, _, r in c] if rows is not None else None)
                   for w, c in zip(self.rollout_workers, chunks) if c]
        return [RolloutSample.from_worker(o) for w, t in zip(self.rollout_workers, tickets) for o in w.result(t)]

    def score(self, samples: list[dict]) -> list[dict]:
        """Spread reward inputs over the reward actors; each scores within its hard per-call timeout."""
        chunks = split_evenly(samples, len(self.reward_workers))
        tickets = [w.submit("score", c) for w, c in zip(self.reward_workers, chunks) if c]
        return [r for w, t in zip(self.reward_workers, tickets) for r in w.result(t)]
