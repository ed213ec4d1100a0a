"""Apply one forward's candidates to the rows that took part: the draft-and-edit step (with DELETE / INSERT
when on) for rows decoding a block, a Multi-Block Editing pass for rows revising a window.

The decisions are the pure functions of `rollout.steps` and `rollout.levenshtein`; this module writes their
outcome into the engine's slot tensors (canvas, trace, block counters) and the sequences' counters and logs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .levenshtein import DEL, INS, lev_log, levenshtein_block_step, shift_trace
from .steps import block_done, block_step, mbe_edit_set


@dataclass
class StepEvent:
    """What one forward did to one sequence (for `on_step` callbacks such as the `--show` view)."""

    seq: int  # index of the sequence in the prompts list
    forward: int  # the sequence's forward index (0-based)
    kind: str  # "block" (draft-and-edit step) or "mbe" (Multi-Block Editing pass)
    block: int  # active block index (for "mbe": the block that just ended)
    prompt_len: int
    canvas: list[int]  # the whole canvas after the step
    filled: list[int] = field(default_factory=list)  # absolute positions filled (M2T)
    edited: list[int] = field(default_factory=list)  # absolute positions rewritten (T2T / MBE)
    block_done: bool = False
    finished: bool = False
    deleted: list[int] = field(default_factory=list)  # absolute positions removed by DELETE (before the shift)
    inserted: list[int] = field(default_factory=list)  # absolute positions that got a [MASK] before them (INSERT)


@dataclass
class SlotTensors:
    """The engine's per-slot device state: canvas (B, T) long, trace (B, T) long (the sequence's forward index
    that last wrote each token, -1 never), post_steps / block_iters (B,) long of the active block."""

    canvas: torch.Tensor
    trace: torch.Tensor
    post_steps: torch.Tensor
    block_iters: torch.Tensor


def apply_block_steps(st: SlotTensors, seqs: list, results: list[tuple], cfg, K: int, mask_id: int,
                      lev_ids, events: list | None) -> tuple[list[bool], list[bool]]:
    """One draft-and-edit iteration for each sequence of `seqs` (all decoding a block); `results[i]` its
    candidates (tok, prob, eprob) over its block. cfg: one `DecodeConfig` for all, or a list with each sequence's
    own; lev_ids: (DELETE id, INSERT id) or None, or a list with each sequence's. Rows with the same settings
    take one batched step; the decisions of a row depend only on its own candidates and settings.
    Returns, per sequence, whether its block ended and whether this iteration wrote anything (a block that
    ended without a write has final keys/values in the cache). Appends a `StepEvent` per sequence to `events`
    when given, in the order of `seqs`."""
    n = len(seqs)
    cfgs = list(cfg) if isinstance(cfg, (list, tuple)) else [cfg] * n
    levs = list(lev_ids) if isinstance(lev_ids, list) else [lev_ids] * n
    groups: dict = {}
    for i in range(n):  # sampling settings do not enter the step: rows that decide alike take one batched step
        groups.setdefault((_decision_settings(cfgs[i]), levs[i]), []).append(i)
    done, wrote = [False] * n, [False] * n
    evs: list = [None] * n
    for (_, lev), members in groups.items():
        ev = [] if events is not None else None
        d, w = _apply_group(st, [seqs[i] for i in members], [results[i] for i in members], cfgs[members[0]], K,
                            mask_id, lev, ev)
        for j, i in enumerate(members):
            done[i], wrote[i] = d[j], w[j]
            if ev is not None:
                evs[i] = ev[j]
    if events is not None:
        events.extend(evs)
    return done, wrote


def _decision_settings(cfg) -> tuple:
    """The `DecodeConfig` fields the draft-and-edit step and the block-end rule read (`_apply_group`)."""
    return (cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer, cfg.max_post_steps, cfg.early_commit, cfg.tau_delete,
            cfg.tau_insert, cfg.max_lev_edits)


def _apply_group(st: SlotTensors, seqs: list, results: list[tuple], cfg, K: int, mask_id: int,
                 lev_ids: tuple[int, int] | None, events: list | None) -> tuple[list[bool], list[bool]]:
    """`apply_block_steps` for sequences that share one `DecodeConfig`."""
    dev = st.canvas.device
    slots = torch.tensor([s.slot for s in seqs], device=dev)
    pos = torch.tensor([s.block * K for s in seqs], device=dev)[:, None] + torch.arange(K, device=dev)
    cur = st.canvas[slots[:, None], pos]
    protected = pos < torch.tensor([s.start for s in seqs], device=dev)[:, None]
    tok = torch.stack([r[0] for r in results])
    prob = torch.stack([r[1] for r in results])
    lstep = None
    cap = K + cfg.max_post_steps + 1
    st.block_iters[slots] += 1
    if lev_ids is not None:
        lstep = levenshtein_block_step(tok, prob, torch.stack([r[2] for r in results]), cur, protected, mask_id, cfg,
                                       ops_allowed=st.block_iters[slots] < cap)
        res = lstep.result
    else:
        res = block_step(tok, prob, cur, protected, mask_id, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
    done, st.post_steps[slots] = block_done(res, st.post_steps[slots], st.block_iters[slots], cfg.max_post_steps,
                                            cap, cfg.editing or cfg.levenshtein, prob, cfg.early_commit)
    if lstep is not None:  # never commit a [MASK]: past the cap a shifted-in slot is filled first
        done = done & (res.masks_left == 0)
    st.canvas[slots[:, None], pos] = res.new
    fwd = torch.tensor([s.forwards for s in seqs], device=dev)[:, None]
    if lstep is not None:  # tokens keep their trace as they shift
        st.trace[slots[:, None], pos] = shift_trace(st.trace[slots[:, None], pos], lstep, fwd)
    else:
        st.trace[slots[:, None], pos] = torch.where(res.m2t | res.t2t, fwd, st.trace[slots[:, None], pos])
    n_edit, done_l = res.t2t.sum(-1).tolist(), done.tolist()
    any_write = (res.m2t | res.t2t).any(-1).tolist()
    for j, s in enumerate(seqs):
        s.edits += n_edit[j]
        if n_edit[j]:
            _log_edits(s, j, lstep, res, pos, cur, lev_ids)
        if events is not None:
            events.append(_block_event(s, j, res, lstep, pos, done_l[j]))
        s.forwards += 1
        s.turn_forwards += 1
    return done_l, any_write


def _log_edits(s, j: int, lstep, res, pos: torch.Tensor, cur: torch.Tensor, lev_ids) -> None:
    if lstep is not None:
        s.edit_log += lev_log(lstep, j, pos[j], cur[j], s.prompt_len, *lev_ids)
        s.deletes += int((lstep.ops[j] == DEL).sum())
        s.inserts += int((lstep.ops[j] == INS).sum())
        if ((lstep.ops[j] == DEL) | (lstep.ops[j] == INS)).any():
            s.lev_drafts.setdefault(s.block, cur[j].tolist())
    else:
        e = res.t2t[j]
        s.edit_log += zip((pos[j][e] - s.prompt_len).tolist(), cur[j][e].tolist(), res.new[j][e].tolist())


def _block_event(s, j: int, res, lstep, pos: torch.Tensor, done: bool) -> StepEvent:
    ev = StepEvent(s.id, s.forwards, "block", s.block, s.prompt_len, [], pos[j][res.m2t[j]].tolist(),
                   pos[j][res.t2t[j]].tolist(), done)
    if lstep is not None:
        ev.filled, ev.edited = pos[j][lstep.filled[j]].tolist(), pos[j][lstep.rewritten[j]].tolist()
        ev.deleted = pos[j][lstep.ops[j] == DEL].tolist()
        ev.inserted = pos[j][lstep.ops[j] == INS].tolist()
    return ev


def apply_mbe_pass(st: SlotTensors, s, result: tuple, t_start: int, t_len: int, cfg, K: int,
                   events: list | None) -> bool:
    """One Multi-Block Editing pass of sequence `s` over its window [t_start, t_start + t_len): window tokens
    of the current turn whose candidate differs with probability > mbe_tau are rewritten. Returns True when
    the passes are over (nothing changed, or mbe_max_passes reached)."""
    dev = st.canvas.device
    r = s.slot
    pos = torch.arange(t_start, t_start + t_len, device=dev)
    cur = st.canvas[r, pos]
    tok, prob, _ = result
    # only the current turn is editable: earlier turns were already sent to the environment
    change = mbe_edit_set(tok, prob, cur, pos >= s.start, cfg.mbe_tau)
    st.canvas[r, pos] = torch.where(change, tok, cur)
    st.trace[r, pos] = torch.where(change, s.forwards, st.trace[r, pos])
    changed = pos[change]
    n_changed = int(changed.numel())
    if n_changed:
        s.edit_log += zip((changed - s.prompt_len).tolist(), cur[change].tolist(), tok[change].tolist())
        first = int(changed.min()) // K
        s.mbe_first_changed = first if s.mbe_first_changed is None else min(first, s.mbe_first_changed)
    s.mbe_edits += n_changed
    s.edits += n_changed
    if events is not None:
        events.append(StepEvent(s.id, s.forwards, "mbe", s.block, s.prompt_len, [], [], changed.tolist(), True))
    s.forwards += 1
    s.turn_forwards += 1
    s.mbe_passes += 1
    return n_changed == 0 or s.mbe_passes >= cfg.mbe_max_passes
