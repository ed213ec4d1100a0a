"""The RL driver: `ebpo train recipes/rl_*.yaml key=value ...`.

One step, as in DESIGN.md:

    prompts -> rollout workers (G samples each, temperature sampling)   -> reward workers (scores)
            -> advantages per prompt group -> learner (old composite, mu epochs of EBPO)
            -> weights to the rollout workers -> metrics, sample table, checkpoint

The driver holds no model: rollout, reward and learner workers are Ray actors (a local Ray instance is
started when no address is configured). Every source of randomness derives from `trainer.seed` and the
step number, so a run resumed from a checkpoint repeats the uninterrupted run's later steps.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from .config import build, load_config, save_config, to_dict
from .rl_batch import (build_learner_batch, filter_groups, first_groups, reward_metrics, rollout_metrics,
                       zero_std_groups)
from .rl_config import RLConfig

log = logging.getLogger("ebpo")


def derive_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (step, sample index, ...): no global RNG involved."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def _brief(err: BaseException) -> str:
    """`Type: first line` of an error, unwrapping a Ray task error to the exception raised in the actor."""
    cause = getattr(err, "cause", None) or err
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0][:300] if lines else ''}"


def _solved(result: dict, judges: list[str] | None = None) -> float:
    """1.0 when every judging reward (`judges`, default all) that applies to the row (not skipped) gives
    full marks, else 0.0.

    With `fns: [math, code]` on mixed prompts, math rows are judged by `math` (code skips them: no tests)
    and code rows by `code`; a row no reward applies to counts as unsolved. Shaping rewards (`judge:
    false`) are left out."""
    values = [v for n, v in result["rewards"].items() if v is not None and (judges is None or n in judges)]
    return float(bool(values) and all(v >= 1 - 1e-6 for v in values))


class PromptSampler:
    """Epoch-wise shuffled, resumable stream of training rows; its state is (epoch, position)."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("data.train: the training set is empty")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(derive_seed(self.seed, self.epoch)).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()


class LearnerActor:
    """Builds the learner inside its own process (so the driver never holds a model) and forwards calls."""

    def __init__(self, model_spec: str, learner_fields: dict, num_threads: int = 0):
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        from .learner import EBPOLearner, LearnerConfig
        from .model.loading import load_model

        self.learner = EBPOLearner(load_model(model_spec), build(LearnerConfig, learner_fields, "learner."))
        self.sync_group = None  # WeightBroadcastGroup (rank 0) with ray.weight_sync=broadcast

    def update(self, batch: dict) -> dict:
        return self.learner.update(batch)

    def state_dict_for_sync(self) -> dict:
        return self.learner.state_dict_for_sync()

    def weights_digest(self) -> dict:
        """SHA-256 and counts of `state_dict_for_sync()` (see `ebpo.weight_sync.state_dict_digest`)."""
        from .weight_sync import state_dict_digest

        return state_dict_digest(self.learner.state_dict_for_sync())

    # Broadcast weight sync (ray.weight_sync=broadcast): the learner is rank 0 and hosts the group's store.
    def sync_endpoint(self) -> tuple[str, int]:
        """(node IP, free port) on which `join_sync_group` will host the group's TCPStore."""
        from .weight_sync import learner_endpoint

        return learner_endpoint()

    def join_sync_group(self, addr: str, port: int, world_size: int, timeout_s: float, device: str = "cpu") -> None:
        """Form the group as rank 0; blocks until all `world_size` members join (up to `timeout_s`)."""
        from .weight_sync import WeightBroadcastGroup

        self.close_sync_group()
        self.sync_group = WeightBroadcastGroup(addr, port, 0, world_size, timeout_s=timeout_s, device=device)

    def broadcast_weights(self, version: int, bucket_bytes: int) -> dict:
        """Send `state_dict_for_sync()` as `version`; returns {"bytes", "buckets", "seconds"} of the send."""
        if self.sync_group is None:
            raise RuntimeError("broadcast_weights: the learner is in no weight-sync group")
        stats = self.sync_group.send(self.learner.state_dict_for_sync(), version, bucket_bytes)
        return stats._asdict()

    def close_sync_group(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
            self.sync_group = None

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> None:
        self.learner.load(path)

    def export(self, path: str) -> None:
        self.learner.get_model().save_pretrained(path)


class RLTrainer:
    def __init__(self, cfg: RLConfig, recipe_name: str = "rl"):
        import ray

        from rewards import RewardWorker

        from .data import load_rows
        from .learner import LearnerConfig
        from .model.loading import load_model_tokenizer, resolve_model_path
        from .tracking import Tracker

        self.cfg = cfg
        self.ray = ray
        tc = cfg.trainer
        self.resume_dir = Path(tc.resume) if tc.resume else None
        self.run_dir = self.resume_dir or Path(tc.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        learner_fields = {"total_steps": tc.steps, "seed": tc.seed, **cfg.learner}
        self.learner_cfg = build(LearnerConfig, learner_fields, "learner.")  # fail now, not inside an actor
        self.model_spec = resolve_model_path(cfg.model)
        self.tokenizer = load_model_tokenizer(self.model_spec)
        self.train_rows = load_rows(cfg.data.train)
        self.eval_rows = load_rows(cfg.data.eval) if cfg.data.eval else []
        if tc.eval_size and self.eval_rows:
            self.eval_rows = self.eval_rows[: tc.eval_size]
        self.sampler = PromptSampler(self.train_rows, tc.seed, cfg.data.shuffle)
        self.reward_specs = [(f.fn, f.weight, f.kwargs) for f in cfg.reward.fns]
        from rewards import as_spec

        self.reward_names = [as_spec(s).name for s in self.reward_specs]
        self.judge_names = [n for n, f in zip(self.reward_names, cfg.reward.fns) if f.judge]
        self.events: list[str] = []
        self.start_step = 0
        self.latest_weights = None  # ObjectRef of the last synced state_dict (restarted workers load it)
        self.version = 0
        # ray.weight_sync=broadcast: each rollout worker's `restarts` when the group was formed (None: no
        # group), and broadcast failures in a row (past MAX_BROADCAST_FAILURES the run keeps the object store).
        self._group_restarts: list[int] | None = None
        self._broadcast_failures = 0
        self.eos_id = self.tokenizer.eos_token_id

        # A user's reward is checked once, in-process, on a real row, before any actor starts.
        with RewardWorker(self.reward_specs, num_workers=1, timeout_s=cfg.reward.timeout_s,
                          default_score=cfg.reward.default_score) as probe:
            probe.dry_run(self._reward_sample(self.train_rows[0], ""))

        if not ray.is_initialized():
            ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.WARNING)
        self._start_actors()
        run_id = None
        if self.resume_dir:
            run_id = self._restore()
        self.tracker = Tracker(self.run_dir, to_dict(cfg), project=tc.wandb_project, mode=tc.tracking, run_id=run_id)

    # ----------------------------------------------------------------------------------------- actors
    def _start_actors(self) -> None:
        from rewards import RewardWorker

        from rollout.worker import RolloutWorker

        from .actors import ResilientActor

        cfg, ray = self.cfg, self.ray
        decode = {"preset": cfg.rollout.preset, **cfg.rollout.decode}
        threads = cfg.rollout.num_threads or os.cpu_count() or 1
        rollout_cls = ray.remote(num_cpus=0, num_gpus=cfg.ray.rollout_gpus)(RolloutWorker)
        reward_cls = ray.remote(num_cpus=cfg.ray.reward_cpus)(RewardWorker)
        learner_cls = ray.remote(num_cpus=0, num_gpus=cfg.ray.learner_gpus)(LearnerActor)
        placement = self._placement()

        def rollout_factory(i: int):
            return rollout_cls.options(**placement(i)).remote(
                self.model_spec, decode, num_threads=threads, fp8=cfg.rollout.fp8,
                device="cuda" if cfg.ray.rollout_gpus > 0 else "cpu",
                weights=self._restart_weights(), weights_version=self.version)

        def reward_factory():
            return reward_cls.remote(self.reward_specs, num_workers=cfg.reward.num_workers,
                                     timeout_s=cfg.reward.timeout_s, default_score=cfg.reward.default_score)

        retries = cfg.trainer.max_retries
        self.rollout_workers = [ResilientActor(f"rollout-{i}", functools.partial(rollout_factory, i), retries,
                                               self._event) for i in range(cfg.rollout.num_workers)]
        self.reward_workers = [ResilientActor(f"reward-{i}", reward_factory, retries, self._event)
                               for i in range(cfg.reward.num_actors)]
        self.learner = learner_cls.options(**placement(cfg.rollout.num_workers)).remote(
            self.model_spec, asdict(self.learner_cfg), cfg.rollout.num_threads)
        if cfg.ray.weight_sync == "broadcast":
            self._form_sync_group()

    def _restart_weights(self):
        """Weights for a (re)started rollout worker: None (the base model) before the first sync, else the
        last synced policy (an ObjectRef, resolved by Ray when the actor is created)."""
        if self.cfg.ray.weight_sync == "object_store" or self.version == 0:
            return self.latest_weights
        # Broadcast mode keeps no copy in the object store, so ask the learner. Its weights equal the last
        # synced ones here: sync_weights runs right after every learner.update (step), and a worker is only
        # (re)started outside that pair -- during rollout, reward or evaluation, or inside the sync itself,
        # whose version is the learner's current weights. The learner runs calls in order, so this read
        # comes after any update already submitted.
        return self.learner.state_dict_for_sync.remote()

    def _placement(self):
        """index -> actor options. With `ray.colocate`, one STRICT_PACK placement group holds a bundle per
        rollout worker (0..n-1) and one for the learner (n), so they share a node (and its GPUs); a restarted
        rollout worker returns to its own bundle. Otherwise Ray's default scheduler places each actor."""
        cfg, ray = self.cfg, self.ray
        if not cfg.ray.colocate:
            return lambda i: {}
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def bundle(gpus: float) -> dict:
            return {"CPU": 1.0, **({"GPU": gpus} if gpus > 0 else {})}

        bundles = [bundle(cfg.ray.rollout_gpus)] * cfg.rollout.num_workers + [bundle(cfg.ray.learner_gpus)]
        self.placement_group = placement_group(bundles, strategy="STRICT_PACK", name=f"{cfg.name}-policy")
        if not self.placement_group.wait(timeout_seconds=120):
            raise RuntimeError(f"ray.colocate: the cluster cannot place {bundles} on one node within 120 s; "
                               "lower ray.rollout_gpus / ray.learner_gpus or set ray.colocate=false")
        return lambda i: {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=i)}

    def _event(self, message: str) -> None:
        log.warning(message)
        self.events.append(message)

    # ----------------------------------------------------------------------------------------- pieces
    def encode_prompt(self, row: dict) -> list[int]:
        text = row[self.cfg.data.prompt_field]
        if self.cfg.data.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.cfg.data.max_prompt_tokens:]

    def _reward_sample(self, row: dict, completion: str) -> dict:
        return {"prompt": row[self.cfg.data.prompt_field], "completion": completion, "answer": row.get("answer"),
                "tests": row.get("tests"), "metadata": {k: v for k, v in row.items()
                                                        if k not in ("prompt", "answer", "tests", "response")}}

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], decode: dict | None = None) -> list[dict]:
        """Spread prompts over the rollout workers, in order; a dead worker is restarted and its share retried."""
        from .actors import split_evenly

        chunks = split_evenly(list(zip(prompt_ids, seeds)), len(self.rollout_workers))
        tickets = [w.submit("generate", [p for p, _ in c], [s for _, s in c], decode)
                   for w, c in zip(self.rollout_workers, chunks) if c]
        return [o for w, t in zip(self.rollout_workers, tickets) for o in w.result(t)]

    def score(self, samples: list[dict]) -> list[dict]:
        """Spread samples over the reward actors; each scores within its hard per-call timeout."""
        from .actors import split_evenly

        chunks = split_evenly(samples, len(self.reward_workers))
        tickets = [w.submit("score", c) for w, c in zip(self.reward_workers, chunks) if c]
        return [r for w, t in zip(self.reward_workers, tickets) for r in w.result(t)]

    def sync_weights(self) -> dict[str, float]:
        """Bring every rollout worker to the learner's weights as version + 1; returns sync/* metrics
        (broadcast mode only: bytes and buckets broadcast, both 0 when that sync fell back)."""
        self.version += 1
        if self.cfg.ray.weight_sync == "object_store":
            self._sync_by_object_store()
            return {}
        if self._broadcast_failures >= self.MAX_BROADCAST_FAILURES:
            self._sync_by_object_store()
            self.latest_weights = None  # restarted workers ask the learner (see _restart_weights)
            return {"sync/bytes": 0.0, "sync/buckets": 0.0}
        return self._sync_by_broadcast()

    def _sync_by_object_store(self) -> None:
        self.latest_weights = self.learner.state_dict_for_sync.remote()
        tickets = [w.submit("load_weights", self.latest_weights, self.version) for w in self.rollout_workers]
        for w, t in zip(self.rollout_workers, tickets):
            w.result(t)

    # ----------------------------------------------------------------------------------------- broadcast sync
    MAX_BROADCAST_FAILURES = 3  # broadcast failures in a row before the run stays on the object store

    def _sync_by_broadcast(self) -> dict[str, float]:
        """One bucketed broadcast, learner -> all rollout workers. A worker restarted since the group was
        formed is not a member, and a failed broadcast leaves members in unknown states: both fall back to
        the object store for this sync and re-form the group on a new port."""
        if self._group_restarts is None:
            return self._fall_back("no weight-sync group")
        if self._group_restarts != [w.restarts for w in self.rollout_workers]:
            return self._fall_back("a rollout worker was restarted since the weight-sync group was formed")
        send = self.learner.broadcast_weights.remote(self.version, max(1, int(self.cfg.ray.bucket_mb * 2**20)))
        receives = [w.handle.receive_weights.remote(self.version) for w in self.rollout_workers]
        try:
            stats = self._get_all([send, *receives])[0]
        except Exception as err:  # noqa: BLE001 (actor death, gloo/NCCL error or timeout: all handled alike)
            self._broadcast_failures += 1
            return self._fall_back(f"broadcast failed ({_brief(err)})")
        self._broadcast_failures = 0
        return {"sync/bytes": float(stats["bytes"]), "sync/buckets": float(stats["buckets"])}

    def _get_all(self, refs: list) -> list:
        """Wait until every call has finished (so no member is still inside a collective), then return their
        results or raise the first error. Each wait inside the group is bounded by ray.sync_timeout_s."""
        self.ray.wait(refs, num_returns=len(refs))
        results, errors = [], []
        for ref in refs:
            try:
                results.append(self.ray.get(ref))
            except Exception as err:  # noqa: BLE001
                errors.append(err)
        if errors:
            raise errors[0]
        return results

    def _fall_back(self, reason: str) -> dict[str, float]:
        self._event(f"weight sync v{self.version}: {reason}; using the object store for this sync and "
                    "re-forming the broadcast group")
        self._sync_by_object_store()  # restarts any dead rollout worker (ResilientActor) with these weights
        self.latest_weights = None  # restarted workers ask the learner (see _restart_weights)
        self._form_sync_group()
        return {"sync/bytes": 0.0, "sync/buckets": 0.0}

    def _close_sync_group(self) -> None:
        """Close the group on every member; a restarted worker has none, a dead one cannot answer."""
        refs = [self.learner.close_sync_group.remote()] + [w.handle.close_sync_group.remote()
                                                            for w in self.rollout_workers]
        self.ray.wait(refs, num_returns=len(refs), timeout=60)
        self._group_restarts = None

    def _form_sync_group(self) -> None:
        """(Re-)form the group: learner rank 0, rollout worker i rank i + 1, on a fresh port. All joins are
        submitted at once: the learner's TCPStore and the backend wait for every member."""
        rc = self.cfg.ray
        self._close_sync_group()
        if self._broadcast_failures >= self.MAX_BROADCAST_FAILURES:
            self._event(f"weight sync: {self._broadcast_failures} broadcast failures in a row; the object store "
                        "carries the weights for the rest of the run")
            return
        for w, t in [(w, w.submit("ping")) for w in self.rollout_workers]:
            w.result(t)  # a dead worker would stall every join until the timeout: restart it first
        n = len(self.rollout_workers) + 1
        # NCCL only when every member holds a whole GPU: fractional GPUs may share a device, which NCCL refuses.
        device = "cuda" if rc.learner_gpus >= 1 and rc.rollout_gpus >= 1 else "cpu"
        try:
            addr, port = self.ray.get(self.learner.sync_endpoint.remote())
            joins = [self.learner.join_sync_group.remote(addr, port, n, rc.sync_timeout_s, device)]
            joins += [w.handle.join_sync_group.remote(addr, port, i + 1, n, rc.sync_timeout_s, device)
                      for i, w in enumerate(self.rollout_workers)]
            self._get_all(joins)
        except Exception as err:  # noqa: BLE001
            self._broadcast_failures += 1
            self._event(f"weight sync: could not form the broadcast group ({_brief(err)}); the next sync uses "
                        "the object store and tries again")
            return
        self._group_restarts = [w.restarts for w in self.rollout_workers]

    # ----------------------------------------------------------------------------------------- the step
    def step(self, step: int) -> dict:
        cfg, G = self.cfg, self.cfg.rollout.group_size
        times: dict[str, float] = {}

        @contextmanager
        def timed(name):  # accumulates: dynamic sampling runs rollout and reward once per round
            t0 = time.perf_counter()
            yield
            key = f"timing_s/{name}"
            times[key] = times.get(key, 0.0) + time.perf_counter() - t0

        t_step = time.perf_counter()
        P = cfg.rollout.prompts_per_step
        rows, prompt_ids, samples, results = [], [], [], []
        for _ in range(1 + cfg.trainer.dynamic_sampling):
            new_rows = self.sampler.next(P)
            new_ids = [p for p in (self.encode_prompt(r) for r in new_rows) for _ in range(G)]
            # seeds continue the sample index across rounds, so round 0 is the run without dynamic sampling
            seeds = [derive_seed(cfg.trainer.seed, step, len(prompt_ids) + i) for i in range(len(new_ids))]
            with timed("rollout"):
                new_samples = self.generate(new_ids, seeds)
            with timed("reward"):
                results += self.score([self._reward_sample(new_rows[i // G], s["text"])
                                       for i, s in enumerate(new_samples)])
            rows, prompt_ids, samples = rows + new_rows, prompt_ids + new_ids, samples + new_samples
            group_ids = torch.arange(len(rows)).repeat_interleave(G)
            scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
            if not cfg.trainer.dynamic_sampling or int((~zero_std_groups(scores, group_ids)).sum()) >= P:
                break

        from .algos import compute_advantages

        advantages = compute_advantages(scores, group_ids, method=cfg.trainer.advantage,
                                        std_normalize=cfg.trainer.advantage_std)
        metrics = reward_metrics(scores, group_ids, {n: [r["rewards"].get(n) for r in results]
                                                     for n in self.reward_names})
        metrics["reward/timeouts"] = float(sum(bool(r.get("timeout")) for r in results))
        metrics["reward/errors"] = float(sum(bool(r.get("error")) for r in results))
        max_new = int(cfg.rollout.decode.get("max_new_tokens", 0) or 0) or max(len(s["token_ids"]) for s in samples)
        metrics.update(rollout_metrics(samples, max_new, times["timing_s/rollout"]))

        keep = torch.ones(len(samples), dtype=torch.bool)
        if cfg.trainer.filter_zero_std:
            keep = filter_groups(first_groups(~zero_std_groups(scores, group_ids), P), group_ids)
        metrics["train/samples"] = float(keep.sum())
        metrics["train/prompts_drawn"] = float(len(rows))
        if keep.any():
            idx = keep.nonzero().flatten().tolist()
            batch = build_learner_batch([prompt_ids[i] for i in idx], [samples[i]["token_ids"] for i in idx],
                                        advantages[keep], group_ids[keep], pad_id=self.eos_id)
            t0 = time.perf_counter()
            metrics.update(self.ray.get(self.learner.update.remote(batch)))
            train_tokens = int(batch["input_ids"].numel())
            metrics["perf/train_tokens_per_s"] = train_tokens / max(time.perf_counter() - t0, 1e-9)
            with timed("sync"):
                metrics.update(self.sync_weights())
        metrics.update(times)
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics["faults/restarts"] = float(sum(w.restarts for w in self.rollout_workers + self.reward_workers))
        table = [[rows[i // G][cfg.data.prompt_field], samples[i]["text"], float(scores[i]), samples[i]["tpf"]]
                 for i in range(0, len(samples), max(1, len(samples) // max(cfg.trainer.samples_per_step, 1)))]
        self.tracker.log_table("samples", ["prompt", "completion", "reward", "tpf"],
                               table[: cfg.trainer.samples_per_step], step)
        return metrics

    def evaluate(self) -> dict:
        """Greedy Quality-Mode accuracy on the held-out rows, per task and overall (see `_solved`)."""
        if not self.eval_rows:
            return {}
        decode = {"preset": self.cfg.rollout.eval_preset, **self.cfg.rollout.eval_decode}
        prompts = [self.encode_prompt(r) for r in self.eval_rows]
        outs = self.generate(prompts, [0] * len(prompts), decode)
        results = self.score([self._reward_sample(r, o["text"]) for r, o in zip(self.eval_rows, outs)])
        per_task: dict[str, list[float]] = {}
        for row, res in zip(self.eval_rows, results):
            task = row.get("task") or self.reward_names[0]
            per_task.setdefault(task, []).append(_solved(res, self.judge_names))
        m = {f"eval/{t}/accuracy": sum(v) / len(v) for t, v in per_task.items()}
        solved = [x for v in per_task.values() for x in v]
        m["eval/accuracy"] = sum(solved) / len(solved)
        m["eval/tpf"] = sum(len(o["token_ids"]) for o in outs) / max(sum(o["num_forwards"] for o in outs), 1)
        return m

    # ----------------------------------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Path:
        ckpt_root = self.run_dir / "checkpoints"
        path = ckpt_root / f"step_{step}"
        tmp = ckpt_root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.ray.get(self.learner.save.remote(str(tmp / "learner")))
        self.ray.get(self.learner.export.remote(str(tmp / "model")))  # `ebpo export` reads this
        self.tokenizer.save_pretrained(str(tmp / "model"))
        state = {"step": step, "sampler": self.sampler.state(), "version": self.version,
                 "wandb_run_id": self.tracker.run_id, "events": self.events}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # a crash mid-save never leaves a half checkpoint behind `latest`
        (ckpt_root / "latest").write_text(path.name)
        kept = sorted((p for p in ckpt_root.glob("step_*")), key=lambda p: int(p.name.split("_")[1]))
        for old in kept[: -self.cfg.trainer.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _restore(self) -> str | None:
        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"trainer.resume: no checkpoint in {self.run_dir}/checkpoints")
        path = self.run_dir / "checkpoints" / latest.read_text().strip()
        state = json.loads((path / "trainer_state.json").read_text())
        self.ray.get(self.learner.load.remote(str(path / "learner")))
        self.sampler.restore(state["sampler"])
        self.start_step = state["step"]
        self.version = state["version"]
        self.events = state.get("events", [])
        self.sync_weights()
        return state.get("wandb_run_id")

    # ----------------------------------------------------------------------------------------- the loop
    def fit(self) -> list[dict]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        tc = self.cfg.trainer
        history: list[dict] = []
        if self.start_step == 0 and self.eval_rows:
            self.tracker.log(self.evaluate(), step=0)
        last = tc.steps if tc.stop_after is None else min(tc.steps, tc.stop_after)
        columns = [TextColumn("[bold]RL"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        with Progress(*columns, disable=not tc.progress, transient=False) as progress:
            task = progress.add_task("rl", total=tc.steps, completed=self.start_step, info="")
            for step in range(self.start_step + 1, last + 1):
                metrics = self.step(step)
                if self.eval_rows and ((tc.eval_every and step % tc.eval_every == 0) or step == tc.steps):
                    metrics.update(self.evaluate())
                self.tracker.log(metrics, step=step)
                history.append({"step": step, **metrics})
                acc = {k: v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("accuracy")}
                progress.update(task, advance=1, info=f"reward {metrics['reward/mean']:.3f} "
                                + " ".join(f"{k.split('/')[1]} acc {v:.3f}" for k, v in acc.items()))
                if (tc.save_every and step % tc.save_every == 0) or step == last:
                    self.save(step)
        return history

    def close(self) -> None:
        """Plots, W&B finish, then the actors and the placement group are released (the Ray instance stays)."""
        try:
            if self.cfg.trainer.plots:
                from .plots import plot_run

                plot_run(self.run_dir)
            self.tracker.finish()
        finally:
            self._stop_actors()

    def _stop_actors(self) -> None:
        ray = self.ray
        try:  # reward actors own worker processes: close them before the actor goes
            ray.get([w.handle.close.remote() for w in self.reward_workers], timeout=30)
        except Exception:  # noqa: BLE001 (an actor that is already gone needs no closing)
            pass
        for handle in [w.handle for w in self.rollout_workers + self.reward_workers] + [self.learner]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "placement_group", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None


def run(recipe: str | None, overrides: list[str]) -> Path:
    """Entry point of `ebpo train` for kind rl: load and check the recipe, train, plot, return the run dir."""
    cfg = load_config(RLConfig, recipe, overrides)
    if cfg.trainer.tracking == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    trainer = RLTrainer(cfg, Path(recipe).stem if recipe else "rl")
    try:
        trainer.fit()
    finally:
        trainer.close()
    print(f"run directory: {trainer.run_dir}")
    return trainer.run_dir
