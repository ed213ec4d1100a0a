"""The driver's side of partial rollouts (`trainer.partial_rollouts`): a step trains on the prompt groups that
finished, and the unfinished ones carry over to the next step instead of being waited for.

    collect_partial(run, step, weights)
        draw new prompts so that prompts_per_step + trainer.partial_extra_groups groups are in flight;
            the n-th group started goes to rollout worker n mod W (deterministic)
        every worker: continue its carried sequences under the weights held now, start its new groups, and
            decode until its share of prompts_per_step groups is complete (`RolloutWorker.generate_partial`)
        score the returned groups -> StepRecord (`ebpo.rl.step_record.build_record`)

Each sample carries the weight version of every block it decoded (`block_versions`); the learner takes each
block's behaviour term from its own version (docs/ebpo.md, "Block-exact behaviour terms"). Lag bound: a
group holding a sequence whose oldest block would be more than `trainer.partial_max_lag` versions behind the
learner that trains this step is dropped by its worker and counted (`partial/dropped`). With
`trainer.partial_overdue=wait` (the default) no group gets there: a step also waits for every group the next
step would drop, and trains it beyond the prompts_per_step. A rollout worker that
dies loses its in-flight groups, counted as `partial/lost`; the run goes on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ebpo.rl.actors import split_evenly
from ebpo.rl.prompts import derive_seed, reward_input
from ebpo.rl.records import RolloutSample, StepRecord
from ebpo.rl.step_record import build_record, timed
from ebpo.rl.weights import Weights


@dataclass
class PartialLedger:
    """The prompt groups started and not yet trained on: tag -> {"row", "ids" (prompt ids), "worker"};
    cumulative counts of sequences dropped for staleness and lost with a dead worker."""
    pending: dict = field(default_factory=dict)
    dropped: int = 0
    lost: int = 0
    started: int = 0  # groups started so far (group n goes to rollout worker n mod W)

    def state(self) -> dict:
        return {"pending": dict(self.pending), "dropped": self.dropped, "lost": self.lost, "started": self.started}

    @classmethod
    def from_state(cls, state: dict) -> "PartialLedger":
        return cls(pending=dict(state["pending"]), dropped=int(state["dropped"]), lost=int(state["lost"]),
                   started=int(state["started"]))


def extra_groups(cfg) -> int:
    """`trainer.partial_extra_groups`, or its default rollout.prompts_per_step."""
    extra = cfg.trainer.partial_extra_groups
    return cfg.rollout.prompts_per_step if extra is None else extra


def lag_bound(cfg) -> int:
    """`trainer.partial_max_lag`, or its default max_staleness + 1."""
    tc = cfg.trainer
    return tc.partial_max_lag if tc.partial_max_lag is not None else tc.max_staleness + 1


def train_version(run, weights: Optional[Weights]) -> int:
    """The learner version that will train this step's samples, at most: the version generating them plus the
    asynchronous loop's fixed lag (a step without an update only makes it smaller)."""
    held = weights.version if weights is not None else run.weights.version
    return held + run.cfg.trainer.max_staleness


def collect_partial(run, step: int, weights: Optional[Weights] = None) -> StepRecord:
    """Partial-rollout version of `ebpo.rl.step.collect` (module docstring)."""
    cfg, G, P = run.cfg, run.cfg.rollout.group_size, run.cfg.rollout.prompts_per_step
    ledger: PartialLedger = run.partial
    workers = run.cluster.rollout_workers
    W = len(workers)
    times: dict[str, float] = {}
    # keep P + extra groups in flight: a step takes the first P to complete, the others run on meanwhile
    new_rows = run.sampler.next(max(0, P + extra_groups(cfg) - len(ledger.pending)))
    tags = [f"{step}:{i}" for i in range(len(new_rows))]
    for tag, row in zip(tags, new_rows):
        ledger.pending[tag] = {"row": row, "ids": run.prompts.encode(row), "worker": ledger.started % W}
        ledger.started += 1
    min_version = train_version(run, weights) - lag_bound(cfg)
    # wait: a group the next step would drop (its oldest block would then be past the bound) is finished now
    due_version = min_version + 1 if cfg.trainer.partial_overdue == "wait" else None
    quotas = [len(c) for c in split_evenly(list(range(P)), W)] + [0] * W
    with timed(times, "rollout"), run.weights.holding(weights):
        tickets = []
        for w, worker in enumerate(workers):
            mine = [i for i, t in enumerate(tags) if ledger.pending[t]["worker"] == w]
            ids = [ledger.pending[tags[i]]["ids"] for i in mine for _ in range(G)]
            seeds = [derive_seed(cfg.trainer.seed, step, i * G + j) for i in mine for j in range(G)]
            seq_tags = [tags[i] for i in mine for _ in range(G)]
            rows = [new_rows[i] for i in mine for _ in range(G)] if cfg.env.multi_turn else None
            tickets.append(worker.submit("generate_partial", ids, seeds, seq_tags, quotas[w], min_version, rows,
                                         due_version))
        outs = [worker.result(t) for worker, t in zip(workers, tickets)]
    rows, prompt_ids, samples, metrics = _gather(ledger, outs, G)
    with timed(times, "reward"):
        results = run.cluster.score([reward_input(r, s.text, cfg.data.prompt_field, s)
                                     for r, s in zip([r for r in rows for _ in range(G)], samples)])
    record = build_record(run, step, rows, prompt_ids, samples, results, times)
    record.metrics.update(metrics)
    return record


def _gather(ledger: PartialLedger, outs: list[dict], G: int):
    """The returned groups (rows, per-sample prompt ids, samples) and the step's `partial/*` metrics; the
    ledger forgets returned, dropped and lost groups."""
    rows, prompt_ids, samples = [], [], []
    carried = returned = dropped = lost = 0
    for w, out in enumerate(outs):
        by_tag: dict = {}
        for d in out["samples"]:
            d = dict(d)
            by_tag.setdefault(d.pop("tag"), []).append(RolloutSample.from_worker(d))
        for tag, members in by_tag.items():
            entry = ledger.pending.pop(tag)
            rows.append(entry["row"])
            for s in members:
                prompt_ids.append(entry["ids"] if s.prompt_ids is None else s.prompt_ids)
                samples.append(s)
        st = out["stats"]
        carried += st["carried_tokens"]
        returned += st["returned_tokens"]
        dropped += st["dropped"]
        held = set(out["held"])
        for tag in [t for t, e in ledger.pending.items() if e["worker"] == w and t not in held]:
            if tag in out["dropped_tags"]:
                del ledger.pending[tag]
                continue
            lost += G  # the worker died and came back without it
            del ledger.pending[tag]
    ledger.dropped += dropped
    ledger.lost += lost
    metrics = {"partial/carried_token_share": carried / max(returned, 1), "partial/dropped": float(dropped),
               "partial/lost": float(lost), "partial/groups_started": float(ledger.started),
               "partial/dropped_total": float(ledger.dropped),
               "partial/lost_total": float(ledger.lost), "partial/in_flight_groups": float(len(ledger.pending))}
    return rows, prompt_ids, samples, metrics


def partial_state(run) -> dict:
    """The ledger and every rollout worker's carried sequences (their canvases, generators and block versions):
    what a checkpoint needs to continue exactly. Multi-turn sequences are saved with their environments, which
    must pickle; an environment step still running is waited for first (`RolloutWorker.partial_state`)."""
    return {"ledger": run.partial.state(), "workers": [w.call("partial_state") for w in run.cluster.rollout_workers]}


def restore_workers(run, states: list | None) -> None:
    """Give each rollout worker its saved carried sequences (None: nothing in flight)."""
    for i, w in enumerate(run.cluster.rollout_workers):
        w.call("restore_partial", None if states is None or i >= len(states) else states[i])


def restore_partial(run, state: dict | None) -> None:
    """Restore `partial_state`'s output (None: a checkpoint written without partial rollouts)."""
    run.partial = PartialLedger() if state is None else PartialLedger.from_state(state["ledger"])
    restore_workers(run, None if state is None else state["workers"])
