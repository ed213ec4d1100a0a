"""The RL driver: `ebpo train recipes/rl_*.yaml key=value ...`.

One step, as in docs/architecture.md:

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
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from ebpo.infra.config import load_config, save_config, to_dict
from ebpo.rl.async_pipeline import AsyncSteps, RolloutPipeline, staleness_metrics
from ebpo.rl.learner_actor import LearnerActor
from ebpo.rl.launch import in_ray_job, ray_init_kwargs, resolve_run_dir  # noqa: F401 (re-exported)
from ebpo.rl.learner_group import LearnerGroup, LearnerRankDied
from ebpo.rl.batch import (build_learner_batch, filter_groups, first_groups, reward_metrics, rollout_metrics,
                       zero_std_groups)
from ebpo.rl.config import RLConfig, model_block_size
from ebpo.rl.sync_driver import WeightSyncDriver

log = logging.getLogger("ebpo")


@contextmanager
def _timed(times: dict[str, float], name: str):
    """Adds the block's wall time to times["timing_s/NAME"]."""
    t0 = time.perf_counter()
    yield
    key = f"timing_s/{name}"
    times[key] = times.get(key, 0.0) + time.perf_counter() - t0


def derive_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (step, sample index, ...): no global RNG involved."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


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


class RLTrainer(AsyncSteps):
    def __init__(self, cfg: RLConfig, recipe_name: str = "rl"):
        import ray

        from rewards import RewardWorker

        from ebpo.model.loading import load_model_tokenizer, resolve_model_path
        from ebpo.infra.tracking import Tracker

        self.cfg = cfg
        self.ray = ray
        tc = cfg.trainer
        self.resume_dir = Path(tc.resume) if tc.resume else None
        self.run_dir = resolve_run_dir(tc.resume or tc.run_dir, cfg.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log.warning("run directory: %s", self.run_dir)
        print(f"ebpo: run directory {self.run_dir}", flush=True)
        save_config(cfg, self.run_dir / "config.yaml")
        self.learner_cfg = cfg.learner_config()  # fail now, not inside an actor
        self.model_spec = resolve_model_path(cfg.model)
        for warning in cfg.check_against_model(model_block_size(self.model_spec)):  # block sizes, MBE
            log.warning(warning)
        self.tokenizer = load_model_tokenizer(self.model_spec)
        self.data_metrics: dict[str, float] = {}  # over-long prompts dropped at load time (data.overlong_prompts)
        self.train_rows = self._load_prompts(cfg.data.train, "train")
        self.eval_rows = self._load_prompts(cfg.data.eval, "eval") if cfg.data.eval else []
        if tc.eval_size and self.eval_rows:
            self.eval_rows = self.eval_rows[: tc.eval_size]
        self.sampler = PromptSampler(self.train_rows, tc.seed, cfg.data.shuffle)
        self.reward_specs = [(f.fn, f.weight, f.kwargs) for f in cfg.reward.fns]
        from rewards import as_spec

        self.reward_names = [as_spec(s).name for s in self.reward_specs]
        self.judge_names = [n for n, f in zip(self.reward_names, cfg.reward.fns) if f.judge]
        self.events: list[str] = []
        self.start_step = 0
        self.learner_restarts = 0
        self.weights = WeightSyncDriver(self.ray, cfg.ray, self._event)  # learner -> rollout workers
        # asynchronous RL (trainer.max_staleness > 0): the producer thread, the weights it loads into the
        # rollout workers (under the lock), the learner's latest, in-flight steps of a restored checkpoint
        self.pipeline: RolloutPipeline | None = None
        self.rollout_lock = threading.Lock()
        self.rollout_weights: tuple | None = None  # (version, ObjectRef) the rollout workers hold
        self.latest_weights: tuple | None = None  # (version, ObjectRef) after the learner's last update
        self.in_flight: list[dict] = []
        self.version_log: list[tuple[int, int, list[int]]] = []  # (step, learner version, sample versions)
        self.asynchronous = tc.max_staleness > 0
        self.eos_id = self.tokenizer.eos_token_id

        # A user's reward is checked once, in-process, on a real row, before any actor starts.
        with RewardWorker(self.reward_specs, num_workers=1, timeout_s=cfg.reward.timeout_s,
                          default_score=cfg.reward.default_score) as probe:
            probe.dry_run(self._reward_sample(self.train_rows[0], ""))

        if not ray.is_initialized():
            ray.init(**ray_init_kwargs(cfg.ray, self._event))
        self._start_actors()
        run_id = None
        if self.resume_dir:
            run_id = self._restore()
        self.tracker = Tracker(self.run_dir, to_dict(cfg), project=tc.wandb_project, mode=tc.tracking, run_id=run_id)
        if self.start_step == 0:
            self.tracker.log(self.data_metrics, step=0)

    # ----------------------------------------------------------------------------------------- actors
    def _start_actors(self) -> None:
        from rewards import RewardWorker

        from rollout.worker import RolloutWorker

        from ebpo.rl.actors import ResilientActor

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
                **self._restart_weights())

        def reward_factory():
            return reward_cls.remote(self.reward_specs, num_workers=cfg.reward.num_workers,
                                     timeout_s=cfg.reward.timeout_s, default_score=cfg.reward.default_score)

        retries = cfg.trainer.max_retries
        self.rollout_workers = [ResilientActor(f"rollout-{i}", functools.partial(rollout_factory, i), retries,
                                               self._event) for i in range(cfg.rollout.num_workers)]
        self.reward_workers = [ResilientActor(f"reward-{i}", reward_factory, retries, self._event)
                               for i in range(cfg.reward.num_actors)]
        fields = asdict(self.learner_cfg)
        self._new_learner_group = lambda: LearnerGroup(
            ray, lambda rank: learner_cls.options(**placement(cfg.rollout.num_workers + rank)).remote(
                self.model_spec, fields, cfg.rollout.num_threads, rank=rank), self.learner_cfg.num_workers)
        self.learner = self._new_learner_group()
        self.weights.attach(self.learner, self.rollout_workers)

    def _placement(self):
        """index -> actor options for rollout worker i (0..n-1) and learner rank r (index n + r).

        `ray.colocate`: one STRICT_PACK placement group with a bundle per actor, so they share a node (and its
        GPUs); a restarted rollout worker returns to its own bundle. `ray.spread_nodes = m`: one bundle per
        node (STRICT_SPREAD) holding rollout workers i = j mod m and learner ranks r = j mod m. Otherwise Ray's
        default scheduler places each actor."""
        cfg = self.cfg
        if not cfg.ray.colocate and cfg.ray.spread_nodes <= 0:
            return lambda i: {}
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n_rollout, n_learner = cfg.rollout.num_workers, self.learner_cfg.num_workers
        gpus = [cfg.ray.rollout_gpus] * n_rollout + [cfg.ray.learner_gpus] * n_learner

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

    def _event(self, message: str) -> None:
        log.warning(message)
        self.events.append(message)

    # ----------------------------------------------------------------------------------------- pieces
    def encode_prompt(self, row: dict) -> list[int]:
        text = row[self.cfg.data.prompt_field]
        if self.cfg.data.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=False)
        # never cut: rows with longer prompts were filtered (or refused) at load time, `_load_prompts`
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _load_prompts(self, source, split: str) -> list[dict]:
        """Rows of `source` whose prompt fits data.max_prompt_tokens (data.overlong_prompts: filter | error)."""
        from ebpo.infra.data import filter_overlong_prompts, load_rows

        d = self.cfg.data
        rows, dropped = filter_overlong_prompts(load_rows(source), lambda r: len(self.encode_prompt(r)),
                                                d.max_prompt_tokens, d.overlong_prompts, f"data.{split}")
        self.data_metrics[f"data/overlong_{split}_prompts"] = float(dropped)
        if dropped:
            log.warning(f"data.{split}: dropped {dropped} of {len(rows) + dropped} rows whose prompt is longer than "
                        f"data.max_prompt_tokens = {d.max_prompt_tokens} tokens (data.overlong_prompts=filter)")
        return rows

    def _reward_sample(self, row: dict, completion: str, out: dict | None = None) -> dict:
        meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "tests", "response")}
        if out is not None:  # the rollout's decode trace, for rewards on decoding cost (rewards/decode_cost.py)
            meta["decode"] = {"forwards": out["num_forwards"], "tokens": len(out["token_ids"])}
        return {"prompt": row[self.cfg.data.prompt_field], "completion": completion, "answer": row.get("answer"),
                "tests": row.get("tests"), "metadata": meta}

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], decode: dict | None = None,
                 weights: tuple | None = None) -> list[dict]:
        """Spread prompts over the rollout workers, in order; a dead worker is restarted and its share retried.

        `weights` = (version, ObjectRef): load that version first unless the workers hold it (asynchronous
        mode, where the pipeline and evaluation need different versions; the lock keeps load + generate
        together)."""
        from ebpo.rl.actors import split_evenly

        with self.rollout_lock:
            if weights is not None and (self.rollout_weights is None or self.rollout_weights[0] != weights[0]):
                self.rollout_weights = weights  # before the loads: a worker restarted meanwhile gets them too
                tickets = [w.submit("load_weights", weights[1], weights[0]) for w in self.rollout_workers]
                for w, t in zip(self.rollout_workers, tickets):
                    w.result(t)
            chunks = split_evenly(list(zip(prompt_ids, seeds)), len(self.rollout_workers))
            tickets = [w.submit("generate", [p for p, _ in c], [s for _, s in c], decode)
                       for w, c in zip(self.rollout_workers, chunks) if c]
            return [o for w, t in zip(self.rollout_workers, tickets) for o in w.result(t)]

    def score(self, samples: list[dict]) -> list[dict]:
        """Spread samples over the reward actors; each scores within its hard per-call timeout."""
        from ebpo.rl.actors import split_evenly

        chunks = split_evenly(samples, len(self.reward_workers))
        tickets = [w.submit("score", c) for w, c in zip(self.reward_workers, chunks) if c]
        return [r for w, t in zip(self.reward_workers, tickets) for r in w.result(t)]

    def sync_weights(self) -> dict[str, float]:
        """Bring every rollout worker to the learner's weights (`WeightSyncDriver.sync`); sync/* metrics."""
        return self.weights.sync()

    # ----------------------------------------------------------------------------------------- the step
    def step(self, step: int) -> dict:
        """One synchronous step (trainer.max_staleness = 0): collect, update, sync, in that order."""
        t_step = time.perf_counter()
        return self.learn(step, self.collect(step), t_step)

    def collect(self, step: int, weights: tuple | None = None) -> dict:
        """Everything before the update: prompts, rollouts (with `weights` = (version, ObjectRef) loaded
        first, asynchronous mode; None = whatever the workers hold), rewards, dynamic-sampling rounds,
        advantages, the kept rows, and their metrics. Returns a plain record (saved with in-flight steps)."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        times: dict[str, float] = {}
        timed = functools.partial(_timed, times)  # accumulates: dynamic sampling repeats rollout and reward
        P = cfg.rollout.prompts_per_step
        rows, prompt_ids, samples, results = [], [], [], []
        for _ in range(1 + cfg.trainer.dynamic_sampling):
            new_rows = self.sampler.next(P)
            new_ids = [p for p in (self.encode_prompt(r) for r in new_rows) for _ in range(G)]
            # seeds continue the sample index across rounds, so round 0 is the run without dynamic sampling
            seeds = [derive_seed(cfg.trainer.seed, step, len(prompt_ids) + i) for i in range(len(new_ids))]
            with timed("rollout"):
                new_samples = self.generate(new_ids, seeds, weights=weights)
            with timed("reward"):
                results += self.score([self._reward_sample(new_rows[i // G], s["text"], s)
                                       for i, s in enumerate(new_samples)])
            rows, prompt_ids, samples = rows + new_rows, prompt_ids + new_ids, samples + new_samples
            group_ids = torch.arange(len(rows)).repeat_interleave(G)
            scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
            if not cfg.trainer.dynamic_sampling or int((~zero_std_groups(scores, group_ids)).sum()) >= P:
                break

        from ebpo.core.algos import compute_advantages

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
        return {"step": step, "rows": rows, "prompt_ids": prompt_ids, "samples": samples, "scores": scores,
                "group_ids": group_ids, "advantages": advantages, "keep": keep, "metrics": metrics,
                "times": times, "sampler_after": self.sampler.state()}

    def learn(self, step: int, record: dict, t_step: float) -> dict:
        """The update on a collected step, then the weights to the rollout workers (synchronous) or to the
        pipeline (asynchronous); metrics, sample table. `t_step`: when the step's clock started."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        rows, prompt_ids, samples, scores = record["rows"], record["prompt_ids"], record["samples"], record["scores"]
        keep, metrics, times = record["keep"], record["metrics"], record["times"]
        asynchronous = self.pipeline is not None
        if keep.any():
            idx = keep.nonzero().flatten().tolist()
            batch = build_learner_batch([prompt_ids[i] for i in idx], [samples[i]["token_ids"] for i in idx],
                                        record["advantages"][keep], record["group_ids"][keep], pad_id=self.eos_id,
                                        tail_ids=[samples[i].get("tail_ids", []) for i in idx])
            batch["lev_drafts"] = [samples[i].get("lev_drafts", []) for i in idx]  # L-EBPO (learner.levenshtein)
            if asynchronous:  # the learner trains stale rows with the decoupled loss (ebpo.core.offpolicy)
                versions = [samples[i]["weights_version"] for i in idx]
                batch["weight_version"] = torch.tensor(versions, dtype=torch.long)
                metrics.update(staleness_metrics(versions, self.weights.version))
                self.version_log.append((step, self.weights.version, versions))
            t0 = time.perf_counter()
            metrics.update(self.learner.update(batch))
            train_tokens = int(batch["input_ids"].numel())
            metrics["perf/train_tokens_per_s"] = train_tokens / max(time.perf_counter() - t0, 1e-9)
            with _timed(times, "sync"):
                metrics.update(self.publish_weights() if asynchronous else self.sync_weights())
        if asynchronous:
            self.pipeline.publish(step, self.latest_weights)  # rollouts of step + 1 + s use them
        metrics.update(times)
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics["faults/restarts"] = float(sum(w.restarts for w in self.rollout_workers + self.reward_workers)
                                           + self.learner_restarts)
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
        outs = self.generate(prompts, [0] * len(prompts), decode, weights=self.latest_weights)
        results = self.score([self._reward_sample(r, o["text"], o) for r, o in zip(self.eval_rows, outs)])
        per_task: dict[str, list[float]] = {}
        for row, res in zip(self.eval_rows, results):
            task = row.get("task") or self.reward_names[0]
            per_task.setdefault(task, []).append(_solved(res, self.judge_names))
        m = {f"eval/{t}/accuracy": sum(v) / len(v) for t, v in per_task.items()}
        solved = [x for v in per_task.values() for x in v]
        m["eval/accuracy"] = sum(solved) / len(solved)
        m["eval/tpf"] = sum(len(o["token_ids"]) for o in outs) / max(sum(o["num_forwards"] for o in outs), 1)
        m["eval/edits_per_seq"] = sum(o["num_edits"] for o in outs) / len(outs)
        # edit precision of the decoder's rewrites against the rows' correct responses (rollout/edits.py)
        from ebpo.sft.evaluation import edit_metrics, reference_ids
        from rollout.edits import edit_counts

        refs = [reference_ids(self.tokenizer, r) for r in self.eval_rows]
        m.update(edit_metrics([r.get("task") or self.reward_names[0] for r in self.eval_rows],
                              [None if f is None else edit_counts(o.get("edit_log", []), f) for o, f in zip(outs, refs)]))
        return m

    # ----------------------------------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Path:
        ckpt_root = self.run_dir / "checkpoints"
        path = ckpt_root / f"step_{step}"
        tmp = ckpt_root / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.learner.save(str(tmp / "learner"))  # every rank writes its part before the rename below
        self.learner.export(str(tmp / "model"))  # `ebpo export` reads this
        self.tokenizer.save_pretrained(str(tmp / "model"))
        sampler = self.sampler.state()
        if self.pipeline is not None:  # in-flight steps are saved; the sampler stands after the last of them
            in_flight = self.pipeline.in_flight(step)
            torch.save(in_flight, tmp / "in_flight.pt")
            sampler = (in_flight[-1] if in_flight else self._last_record)["sampler_after"]
        state = {"step": step, "sampler": sampler, "version": self.weights.version,
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
        self.learner.load(str(path / "learner"))
        self.sampler.restore(state["sampler"])
        self.start_step = state["step"]
        self.weights.version = state["version"]
        self.events = state.get("events", [])
        if self.asynchronous:  # the pipeline loads weights into the rollout workers when it needs them
            saved = path / "in_flight.pt"
            self.in_flight = torch.load(saved, weights_only=False) if saved.exists() else []
        else:
            self.sync_weights()
        return state.get("wandb_run_id")

    # ----------------------------------------------------------------------------------------- the loop
    def fit(self) -> list[dict]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        tc = self.cfg.trainer
        history: list[dict] = []
        if self.start_step == 0 and self.eval_rows:
            self.tracker.log(self.evaluate(), step=0)
        if self.asynchronous:
            self._start_pipeline()
        last = tc.steps if tc.stop_after is None else min(tc.steps, tc.stop_after)
        columns = [TextColumn("[bold]RL"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        with Progress(*columns, disable=not tc.progress, transient=False) as progress:
            task = progress.add_task("rl", total=tc.steps, completed=self.start_step, info="")
            step = self.start_step
            while step < last:
                step += 1
                try:
                    metrics = self.step(step) if self.pipeline is None else self._async_step(step)
                except LearnerRankDied as err:
                    self._stop_pipeline()
                    step = self._rebuild_learner(err)
                    if self.asynchronous:
                        self._start_pipeline()
                    history = [h for h in history if h["step"] <= step]  # the lost steps are redone
                    progress.update(task, completed=step)
                    continue
                if self.eval_rows and ((tc.eval_every and step % tc.eval_every == 0) or step == tc.steps):
                    metrics.update(self.evaluate())
                self.tracker.log(metrics, step=step)
                history.append({"step": step, **metrics})
                acc = {k: v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("accuracy")}
                progress.update(task, advance=1, info=f"reward {metrics['reward/mean']:.3f} "
                                + " ".join(f"{k.split('/')[1]} acc {v:.3f}" for k, v in acc.items()))
                if (tc.save_every and step % tc.save_every == 0) or step == last:
                    self.save(step)
        self._stop_pipeline()
        return history

    def _rebuild_learner(self, err: Exception) -> int:
        """A learner rank died: start a new learner group, restore it (and the sampler and weight version)
        from the latest checkpoint, or from the initial policy if there is none, bring the rollout workers
        to its weights, and return the step to continue after. Counted in faults/restarts; gives up after
        trainer.max_retries rebuilds."""
        self.learner_restarts += 1
        if self.learner_restarts > self.cfg.trainer.max_retries:
            raise RuntimeError(f"learner: {self.learner_restarts - 1} rebuilds already; giving up") from err
        self._event(f"{err}; rebuilding the learner group from the latest checkpoint")
        self.learner.kill()
        # the object-store parts of the last sync died with their owner (the old rank 0): a rollout worker
        # restarted before the sync below starts from the base weights and is then synced like the others
        self.weights.latest_weights = None
        if self.cfg.ray.weight_sync == "broadcast":
            self.weights.close_group()
        self.learner = self._new_learner_group()
        self.weights.attach(self.learner, self.rollout_workers)
        if (self.run_dir / "checkpoints" / "latest").exists():
            events = self.events
            self._restore()
            self.events = events  # the checkpoint's list predates this failure
            return self.start_step
        self.sampler.restore({"epoch": 0, "position": 0})
        self.start_step, self.weights.version, self.in_flight = 0, 0, []
        if not self.asynchronous:
            self.sync_weights()
        return 0

    def close(self) -> None:
        """Plots, W&B finish, then the actors and the placement group are released (the Ray instance stays)."""
        self._stop_pipeline()
        try:
            if self.cfg.trainer.plots:
                from ebpo.infra.plots import plot_run

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
        self.learner.kill()
        for handle in [w.handle for w in self.rollout_workers + self.reward_workers]:
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
