"""One RL step as functions over typed records, shared by the synchronous and the asynchronous loop:

    collect(run, step, weights)   prompts -> rollouts -> rewards (-> dynamic-sampling rounds) -> advantages
                                  -> StepRecord
    learn(run, record)            StepRecord -> LearnerBatch -> learner update -> metrics
    finish(run, record, metrics)  timing, fault counts and the step's sample table
    evaluate(run, weights)        greedy Quality-Mode accuracy on the held-out rows

The loops decide which weights generate a step and what happens to the learner's new weights; nothing
here depends on the mode. Every seed derives from `trainer.seed` and the step number.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rollout.edits import edit_counts, edit_metrics
from rollout.trajectory import trajectory_text

from ebpo.infra.data import reference_ids
from ebpo.rl.batch import zero_std_groups
from ebpo.rl.episodes import episode_rows
from ebpo.rl.prompts import derive_seed, reward_input
from ebpo.rl.records import RolloutSample, StepRecord, build_learner_batch
from ebpo.rl.run_state import RLRun
from ebpo.rl.step_record import agent_metrics, build_record, timed
from ebpo.rl.weights import Weights


def generate(run: RLRun, prompt_ids: list[list[int]], seeds: list[int], decode: dict | None = None,
             weights: Optional[Weights] = None, rows: list[dict] | None = None) -> list[RolloutSample]:
    """Rollouts of `prompt_ids` with `weights` loaded first (None = whatever the workers hold). With
    `env.name` set, `rows` (one per prompt) go to the environments and the rollouts are multi-turn."""
    with run.weights.holding(weights):
        return run.cluster.generate(prompt_ids, seeds, decode, rows if run.cfg.env.multi_turn else None)


def collect(run: RLRun, step: int, weights: Optional[Weights] = None) -> StepRecord:
    """Everything before the update: prompts, rollouts, rewards, dynamic-sampling rounds, advantages, the
    kept rows and their metrics. `weights`: the version that generates this step (None: whatever the
    rollout workers hold, the synchronous loop)."""
    if run.collector is not None:  # partial rollouts (chosen once at start-up, ebpo.rl.setup)
        return run.collector(run, step, weights)
    cfg, G = run.cfg, run.cfg.rollout.group_size
    times: dict[str, float] = {}
    P = cfg.rollout.prompts_per_step
    rows, prompt_ids, samples, results = [], [], [], []
    for _ in range(1 + cfg.trainer.dynamic_sampling):
        new_rows = run.sampler.next(P)
        new_ids = [p for p in (run.prompts.encode(r) for r in new_rows) for _ in range(G)]
        # seeds continue the sample index across rounds, so round 0 is the run without dynamic sampling
        seeds = [derive_seed(cfg.trainer.seed, step, len(prompt_ids) + i) for i in range(len(new_ids))]
        with timed(times, "rollout"):
            sample_rows = [new_rows[i // G] for i in range(len(new_ids))]
            new_samples = generate(run, new_ids, seeds, weights=weights, rows=sample_rows)
        # a multi-turn sample's prompt is what it decoded after (the environment's first observation included)
        new_ids = [p if s.prompt_ids is None else s.prompt_ids for p, s in zip(new_ids, new_samples)]
        with timed(times, "reward"):
            results += run.cluster.score([reward_input(new_rows[i // G], s.text, cfg.data.prompt_field, s)
                                          for i, s in enumerate(new_samples)])
        rows, prompt_ids, samples = rows + new_rows, prompt_ids + new_ids, samples + new_samples
        group_ids = torch.arange(len(rows)).repeat_interleave(G)
        scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
        if not cfg.trainer.dynamic_sampling or int((~zero_std_groups(scores, group_ids)).sum()) >= P:
            break
    return build_record(run, step, rows, prompt_ids, samples, results, times)


def learn(run: RLRun, record: StepRecord) -> dict[str, float]:
    """The learner update on the record's kept rows (each row carries the weight version that sampled it);
    returns the learner's metrics and `perf/train_tokens_per_s`, or {} when no row is kept."""
    idx = record.kept()
    if not idx:
        return {}
    s = record.samples
    if any(s[i].trajectory is not None and s[i].trajectory.get("segments") for i in idx) or \
            run.cfg.env.episode_norm != "none":  # agent episodes: every segment a row, per-episode weights
        batch = episode_batch(run, record, idx)
    else:
        batch = build_learner_batch([record.prompt_ids[i] for i in idx], [s[i].token_ids for i in idx],
                                    record.advantages[record.keep], record.group_ids[record.keep], pad_id=run.eos_id,
                                    tail_ids=[s[i].tail_ids for i in idx],
                                    weight_version=[s[i].weights_version for i in idx],
                                    lev_drafts=[s[i].lev_drafts for i in idx],
                                    turns=[None if s[i].trajectory is None else
                                           (s[i].trajectory["generated"], s[i].trajectory["segment"]) for i in idx],
                                    block_size=run.block_size,
                                    block_versions=([s[i].block_versions for i in idx]
                                                    if any(s[i].block_versions for i in idx) else None))
    t0 = time.perf_counter()
    metrics = run.cluster.learner.update(batch)
    metrics["perf/train_tokens_per_s"] = int(batch.input_ids.numel()) / max(time.perf_counter() - t0, 1e-9)
    return metrics


def episode_batch(run: RLRun, record: StepRecord, idx: list[int]):
    """The learner batch of the kept rows with every segment of an agent episode as a row and the advantages
    scaled by `env.episode_norm` (`ebpo.rl.episodes`)."""
    rows = episode_rows([record.prompt_ids[i] for i in idx], [record.samples[i] for i in idx],
                        record.advantages[record.keep], record.group_ids[record.keep], run.cfg.env.episode_norm)
    return build_learner_batch(rows.prompt_ids, rows.token_ids, torch.tensor(rows.advantages, dtype=torch.float32),
                               torch.tensor(rows.group_ids, dtype=torch.long), pad_id=run.eos_id,
                               tail_ids=rows.tail_ids, weight_version=rows.weight_version, lev_drafts=rows.lev_drafts,
                               turns=rows.turns, block_size=run.block_size)


def finish(run: RLRun, record: StepRecord, metrics: dict[str, float], t_step: float) -> dict[str, float]:
    """The step's full metrics (the record's, the learner's, timings, `faults/restarts`); logs the sample
    table. `t_step`: when the step's clock started (perf_counter seconds)."""
    cfg, G = run.cfg, run.cfg.rollout.group_size
    out = {**record.metrics, **metrics, **record.times}
    out["timing_s/step"] = time.perf_counter() - t_step
    out["faults/restarts"] = float(run.cluster.restarts())
    samples, every = record.samples, max(1, len(record.samples) // max(cfg.trainer.samples_per_step, 1))
    table = [[record.rows[i // G][cfg.data.prompt_field], samples[i].text, float(record.scores[i]), samples[i].tpf]
             for i in range(0, len(samples), every)]
    run.tracker.log_table("samples", ["prompt", "completion", "reward", "tpf"], table[: cfg.trainer.samples_per_step],
                          record.step)
    if cfg.env.multi_turn:  # the turns, tool calls and results of the same samples
        shown = list(range(0, len(samples), every))[: cfg.trainer.samples_per_step]
        run.tracker.log_table("trajectories", ["prompt", "trajectory", "reward", "turns", "tool_calls", "stop"],
                              [[record.rows[i // G][cfg.data.prompt_field], trajectory_text(samples[i].trajectory),
                                float(record.scores[i]), len(samples[i].trajectory["turns"]),
                                sum(len(t["tool_calls"]) for t in samples[i].trajectory["turns"]),
                                samples[i].trajectory["stop"]] for i in shown], record.step)
    return out


def solved(result: dict, judges: list[str] | None = None) -> float:
    """1.0 when every judging reward (`judges`, default all) that applies to the row (not skipped) gives
    full marks, else 0.0.

    With `fns: [math, code]` on mixed prompts, math rows are judged by `math` (code skips them: no tests)
    and code rows by `code`; a row no reward applies to counts as unsolved. Shaping rewards (`judge:
    false`) are left out."""
    values = [v for n, v in result["rewards"].items() if v is not None and (judges is None or n in judges)]
    return float(bool(values) and all(v >= 1 - 1e-6 for v in values))


def evaluate(run: RLRun, weights: Optional[Weights] = None) -> dict[str, float]:
    """Greedy Quality-Mode accuracy on the held-out rows, per task and overall (see `solved`), decoding and
    edit statistics; `weights` as in `collect`."""
    if not run.eval_rows:
        return {}
    cfg = run.cfg
    decode = {"preset": cfg.rollout.eval_preset, **cfg.rollout.eval_decode}
    prompts = [run.prompts.encode(r) for r in run.eval_rows]
    outs = generate(run, prompts, [0] * len(prompts), decode, weights=weights, rows=run.eval_rows)
    results = run.cluster.score([reward_input(r, o.text, cfg.data.prompt_field, o) for r, o in zip(run.eval_rows, outs)])
    per_task: dict[str, list[float]] = {}
    for row, res in zip(run.eval_rows, results):
        per_task.setdefault(row.get("task") or run.reward_names[0], []).append(solved(res, run.judge_names))
    m = {f"eval/{t}/accuracy": sum(v) / len(v) for t, v in per_task.items()}
    every = [x for v in per_task.values() for x in v]
    m["eval/accuracy"] = sum(every) / len(every)
    if cfg.env.multi_turn:  # the model's tokens per forward; no reference responses to grade edits against
        m["eval/tpf"] = sum(o.tpf * o.num_forwards for o in outs) / max(sum(o.num_forwards for o in outs), 1)
        m.update(agent_metrics(outs, "eval/"))
        return m
    m["eval/tpf"] = sum(len(o.token_ids) for o in outs) / max(sum(o.num_forwards for o in outs), 1)
    m["eval/edits_per_seq"] = sum(o.num_edits for o in outs) / len(outs)
    # edit precision of the decoder's rewrites against the rows' correct responses (rollout/edits.py)
    refs = [reference_ids(run.tokenizer, r) for r in run.eval_rows]
    m.update(edit_metrics([r.get("task") or run.reward_names[0] for r in run.eval_rows],
                          [None if f is None else edit_counts(o.edit_log, f) for o, f in zip(outs, refs)]))
    return m


def evaluates_at(run: RLRun, step: int) -> bool:
    """Whether step `step` ends with an evaluation (every trainer.eval_every steps and the last)."""
    tc = run.cfg.trainer
    return bool(run.eval_rows) and ((tc.eval_every and step % tc.eval_every == 0) or step == tc.steps)


def saves_at(run: RLRun, step: int, last: int) -> bool:
    """Whether step `step` ends with a checkpoint (every trainer.save_every steps and the run's last)."""
    tc = run.cfg.trainer
    return bool(tc.save_every and step % tc.save_every == 0) or step == last


def last_step(run: RLRun) -> int:
    """The step this invocation stops after (trainer.stop_after, at most trainer.steps)."""
    tc = run.cfg.trainer
    return tc.steps if tc.stop_after is None else min(tc.steps, tc.stop_after)


class StepProgress:
    """The rich progress bar of the RL loop (disabled by trainer.progress=false)."""

    def __init__(self, run: RLRun):
        tc = run.cfg.trainer
        columns = [TextColumn("[bold]RL"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        self._progress = Progress(*columns, disable=not tc.progress, transient=False)
        self._task = self._progress.add_task("rl", total=tc.steps, completed=run.start_step, info="")

    def __enter__(self) -> "StepProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def done(self, metrics: dict[str, float]) -> None:
        self._progress.update(self._task, advance=1, info=progress_info(metrics))

    def back_to(self, step: int) -> None:
        self._progress.update(self._task, completed=step)


def progress_info(metrics: dict[str, float]) -> str:
    """The progress line's text: the mean reward and the held-out accuracy of each task
    (`eval/<task>/accuracy`), or the overall `eval/accuracy` when no task is named, never both."""
    per_task = {k.split("/")[1]: v for k, v in metrics.items()
                if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2}
    if not per_task and "eval/accuracy" in metrics:
        per_task = {"eval": metrics["eval/accuracy"]}
    return f"reward {metrics['reward/mean']:.3f}" + "".join(f" {t} acc {v:.3f}" for t, v in per_task.items())
