"""Behaviour-policy composites for asynchronous RL: the learner keeps its last few weight versions.

With `trainer.max_staleness = s` a batch may hold samples of weight versions c - s .. c, c being the
learner's current (proximal) version. The decoupled loss (`ebpo.core.offpolicy`) needs each sample's
composite under the policy that sampled it, on the noise draws of this update. The learner computes it
itself: before an update it snapshots its weights (version c) and keeps the versions a later batch can
still reference; for a stale version it copies that snapshot into the live model, runs the same no-grad
composite pass as the old (proximal) composites, on the same micro-batches, and copies its current
weights back. One code path, one precision, the same batch shapes: a frozen policy gives ratio 1 exactly,
and bf16 forward noise (larger than the clip window, docs/rl.md) cancels instead of entering the weight.
Why the learner and not the rollout workers: docs/rl.md, "Asynchronous RL".
"""
from __future__ import annotations

import torch

from ebpo.rl.learner_steps import micro_steps


class BehaviourSnapshots:
    """Weight versions (CPU state dicts) the learner may still need as behaviour policies.

    keep = max_staleness s: after the update from version c, versions c + 1 - s .. c are kept (s copies).
    """

    def __init__(self, keep: int):
        self.keep = keep
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def record(self, model: torch.nn.Module, version: int) -> None:
        """Snapshot `model`'s weights as `version` (call before the update changes them)."""
        if self.keep > 0:
            self.versions[version] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def prune(self, current: int) -> None:
        """Drop versions no later batch can reference once the learner is at version `current`."""
        for v in [v for v in self.versions if v < current - self.keep]:
            del self.versions[v]

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.versions:
            raise KeyError(f"behaviour weights of version {version} are not kept (kept: {sorted(self.versions)}; "
                           f"learner.max_staleness = {self.keep})")
        return self.versions[version]

    def state(self) -> dict:
        return {"keep": self.keep, "versions": self.versions}

    def restore(self, state: dict) -> None:
        self.versions = dict(state["versions"])


def check_versions(versions: torch.Tensor, current: int, max_staleness: int) -> None:
    """Raise if a sample's weight version is newer than the learner's or more than s versions behind."""
    lo, hi = int(versions.min()), int(versions.max())
    if hi > current or lo < current - max_staleness:
        raise ValueError(f"batch.weight_version: versions {lo}..{hi} outside {current - max_staleness}..{current} "
                         f"(learner at version {current}, learner.max_staleness = {max_staleness})")


def behaviour_composites(learner, ids: torch.Tensor, noise, versions: torch.Tensor, plans, tokens: torch.Tensor,
                         chunk: int, cached: bool) -> torch.Tensor:
    """(B, N) composites of each row under the weights of its version (rows of the current version get the
    current weights' values: the same numbers as the proximal pass).

    learner: the `EBPOLearner` (torch backend); plans: its per-minibatch `(micro-batches, n_micro)` of this
    rank; every micro-batch holding a stale row is recomputed whole, so shapes equal the proximal pass's.
    Rows are summed over ranks as the old composites are.
    """
    dev = learner.device
    current = learner.updates_done
    out = torch.zeros(ids.shape[0], noise.t.shape[0], device=dev)
    stale_versions = sorted({int(v) for v in versions.tolist() if int(v) != current})
    if not stale_versions:
        return out  # every row fresh: the caller uses the proximal composites
    live = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    try:
        with torch.no_grad():
            for version in stale_versions:
                learner.model.load_state_dict(learner.snapshots.get(version))
                for plan in plans:
                    for rows, _, _ in micro_steps(plan, pad=False):
                        of_version = versions[rows] == version
                        if not bool(of_version.any()):
                            continue
                        mb_ids, mb_noise = learner.micro_inputs(ids, noise, rows, tokens)
                        c = learner.composites(learner.fwd, mb_ids, mb_noise, chunk, cached)
                        out[rows[of_version].to(dev)] = c[of_version.to(c.device)].to(dev)
    finally:
        learner.model.load_state_dict(live)
    learner.sum_over_ranks(out)
    return out


def prepare_behaviour(learner, weight_version: torch.Tensor | None, ids: torch.Tensor, noise, plans,
                      tokens: torch.Tensor, chunk: int, cached: bool):
    """Called by `EBPOLearner.update` after the old (proximal) pass, before any weight changes: with
    `learner.max_staleness` > 0, checks `weight_version` (B,) (None: all current), computes the
    stale rows' behaviour composites, snapshots the current weights and drops versions no longer needed.
    Returns None (synchronous learner) or (behav (B, N), stale (B,) bool) on the learner's device."""
    s = learner.cfg.max_staleness
    if s == 0:
        return None
    current = learner.updates_done
    versions = (torch.full((ids.shape[0],), current, dtype=torch.long) if weight_version is None
                else weight_version.long().cpu())
    check_versions(versions, current, s)
    behav = behaviour_composites(learner, ids, noise, versions, plans, tokens, chunk, cached)
    learner.snapshots.record(learner.model, current)
    learner.snapshots.prune(current + 1)
    return behav, (versions != current).to(learner.device)


def behaviour_of_rows(behaviour, rows: torch.Tensor, prox: torch.Tensor) -> torch.Tensor:
    """The behaviour composites (b, N) of micro-batch `rows`: the stale rows' own, the proximal's elsewhere
    (so a fresh row's importance weight is exp(0) = 1 exactly)."""
    behav, stale = behaviour
    rows = rows.to(behav.device)
    return torch.where(stale[rows, None], behav[rows], prox)
