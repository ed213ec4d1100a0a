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

Partial rollouts (`LearnerBatch.block_versions`): a row whose blocks were decoded under several versions
("split row") gets the block-exact behaviour composite sum_b (block b's term under the version that decoded
block b), in the delta form prox + sum_b (term_vb[b] - term_current[b]) (`split_deltas`; docs/ebpo.md,
"Block-exact behaviour terms for partial rollouts"). Rows decoded under one version take the path above
unchanged, bit for bit.
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


def check_block_versions(block_versions: torch.Tensor, scored: torch.Tensor, block_size: int, current: int,
                         max_staleness: int) -> torch.Tensor:
    """The batch's block versions as (B, nb) long on the CPU, nb = ceil(L / K) for `scored` (B, L) bool (the
    positions any draw scores): missing trailing columns read as -1 (undecoded). Raises ValueError naming row
    and block for a version past the batch's blocks, a block with scored positions and no version, a version
    newer than `current`, or one more than `max_staleness` behind it (the oldest block decides staleness)."""
    B, L = scored.shape
    nb = -(-L // block_size)
    bv = block_versions.long().cpu()
    past = bv[:, nb:] >= 0
    if bool(past.any()):
        row, col = (int(x) for x in past.nonzero()[0])
        raise ValueError(f"batch.block_versions: row {row} has a version for block {nb + col}, past the batch's "
                         f"{nb} blocks of {block_size} tokens")
    bv = torch.nn.functional.pad(bv[:, :nb], (0, nb - min(nb, bv.shape[1])), value=-1)
    has = torch.nn.functional.pad(scored.cpu(), (0, nb * block_size - L)).view(B, nb, block_size).any(-1)
    for bad, why in ((has & (bv < 0), "holds scored tokens but no version (-1)"),
                     (bv > current, f"is newer than the learner's version {current}"),
                     ((bv >= 0) & (bv < current - max_staleness),
                      f"is more than learner.max_staleness = {max_staleness} versions behind the learner's "
                      f"version {current}")):
        if bool(bad.any()):
            row, blk = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"batch.block_versions: row {row} block {blk}: version {int(bv[row, blk])} {why}")
    return bv


def split_rows(bv: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows whose decoded blocks (bv (B, nb) >= 0) carry more than one version."""
    decoded = bv >= 0
    hi = torch.where(decoded, bv, -1).amax(1)
    lo = torch.where(decoded, bv, torch.iinfo(torch.long).max).amin(1)
    return decoded.any(1) & (hi != lo)


def split_deltas(learner, ids: torch.Tensor, noise, bv: torch.Tensor, split: torch.Tensor, plans,
                 tokens: torch.Tensor, chunk: int, cached: bool) -> torch.Tensor:
    """(B, N) delta_i = sum_b (term_{v(i,b)}[b] - term_current[b]) of the split rows (0 elsewhere): the
    behaviour composite of a split row is its proximal composite + delta (`behaviour_of_rows`).

    Per-block terms come from `learner.composites(..., blocks=True)` on the proximal pass's micro-batches
    (same shapes, precision and draws), first under the live weights, then under each snapshot a split
    row's block names; a block of the current version (or undecoded, -1) contributes exactly 0. So a frozen
    policy gives delta == 0 exactly, and with it ratio 1 (docs/ebpo.md, "Block-exact behaviour terms").
    bv: (B, nb) from `check_block_versions`. Rows are summed over ranks as the old composites are.
    """
    dev, current = learner.device, learner.updates_done
    N = noise.t.shape[0]
    delta = torch.zeros(ids.shape[0], N, device=dev)
    live_blocks = torch.zeros(ids.shape[0], N, bv.shape[1], device=dev)
    mbs = [rows for plan in plans for rows, _, _ in micro_steps(plan, pad=False) if bool(split[rows].any())]
    if not mbs:
        learner.sum_over_ranks(delta)
        return delta
    with torch.no_grad():
        for rows in mbs:  # the live (current-version) terms, before any snapshot is loaded
            mb_ids, mb_noise = learner.micro_inputs(ids, noise, rows, tokens)
            _, blk = learner.composites(learner.fwd, mb_ids, mb_noise, chunk, cached, blocks=True)
            live_blocks[rows.to(dev), :, : blk.shape[-1]] = blk.to(dev)
        used = bv[split]
        versions = sorted({int(v) for v in used[(used >= 0) & (used != current)].tolist()})
        live = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        try:
            for version in versions:
                learner.model.load_state_dict(learner.snapshots.get(version))
                for rows in mbs:
                    of_v = (bv[rows] == version) & split[rows, None]  # (b, nb) blocks of this version
                    if not bool(of_v.any()):
                        continue
                    mb_ids, mb_noise = learner.micro_inputs(ids, noise, rows, tokens)
                    _, blk = learner.composites(learner.fwd, mb_ids, mb_noise, chunk, cached, blocks=True)
                    nb_mb = blk.shape[-1]  # blocks past the micro-batch's length hold no scored position
                    rd = rows.to(dev)
                    diff = blk.to(dev) - live_blocks[rd, :, :nb_mb]
                    sel = of_v[:, :nb_mb].to(dev)[:, None, :]
                    delta[rd] += torch.where(sel, diff, torch.zeros((), device=dev)).sum(-1)
        finally:
            learner.model.load_state_dict(live)
    learner.sum_over_ranks(delta)
    return delta


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
                      tokens: torch.Tensor, chunk: int, cached: bool, block_versions: torch.Tensor | None = None):
    """Called by `EBPOLearner.update` after the old (proximal) pass, before any weight changes: with
    `learner.max_staleness` > 0, checks `weight_version` (B,) (None: all current) and `block_versions`
    (B, nb) (None: one version per row), computes the stale rows' behaviour composites (whole rows of one
    version) and the split rows' block deltas, snapshots the current weights and drops versions no longer
    needed. Returns None (synchronous learner) or (behav (B, N), stale (B,) bool, split (B,) bool or None) on
    the learner's device; behav holds a split row's delta (`split_deltas`), another stale row's composite."""
    s = learner.cfg.max_staleness
    if s == 0:
        return None
    current = learner.updates_done
    versions = (torch.full((ids.shape[0],), current, dtype=torch.long) if weight_version is None
                else weight_version.long().cpu())
    split = None
    if block_versions is not None:
        bv = check_block_versions(block_versions, noise.scored().any(0), learner.block_size, current, s)
        split = split_rows(bv)
        if not bool(split.any()):
            split = None  # one version per row: today's path, bit for bit
    check_versions(versions, current, s)
    whole = versions if split is None else torch.where(split, current, versions)  # split rows: deltas below
    behav = behaviour_composites(learner, ids, noise, whole, plans, tokens, chunk, cached)
    stale = versions != current
    if split is not None:
        delta = split_deltas(learner, ids, noise, bv, split, plans, tokens, chunk, cached)
        behav = torch.where(split.to(behav.device)[:, None], delta, behav)
        stale, split = stale | split, split.to(learner.device)
    learner.snapshots.record(learner.model, current)
    learner.snapshots.prune(current + 1)
    return behav, stale.to(learner.device), split


def behaviour_of_rows(behaviour, rows: torch.Tensor, prox: torch.Tensor) -> torch.Tensor:
    """The behaviour composites (b, N) of micro-batch `rows`: the stale rows' own, the proximal's elsewhere
    (so a fresh row's importance weight is exp(0) = 1 exactly), and prox + delta for split rows (a frozen
    policy's delta is exactly 0, so their weight is exactly 1 too)."""
    behav, stale, split = behaviour
    rows = rows.to(behav.device)
    out = torch.where(stale[rows, None], behav[rows], prox)
    if split is not None:
        out = torch.where(split[rows, None], prox + behav[rows], out)
    return out
