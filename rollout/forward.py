"""One batched model call of the rollout engine: which canvas slice each ready row runs, and its candidates.

A row decoding its active block runs [committed cache length, block end): the blocks still to commit (the
prompt's whole blocks on its first forward, a block that ended with a write, an observation appended after
a turn) and the active block. A row in a Multi-Block Editing pass runs its window as one enlarged block
(`rollout.layout`). Candidates are computed per group of rows with the same target length, each row from
its own generator, so a row's draws never depend on which rows share the forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import build_layout, gather_span
from .levenshtein import edit_probs
from .sampling import candidates, candidates_at_temperatures
from .steps import penalty_targets


@dataclass
class RowPlan:
    """Per ready row (in forward order): the query slice [q_start, q_end), the group clamp of an MBE window
    (None for plain blocks) and the target span [t_start, t_start + t_len) whose candidates are needed."""

    q_start: list[int]
    q_end: list[int]
    clamp: list[int | None]
    t_start: list[int]
    t_len: list[int]


def plan_rows(seqs, cache, K: int) -> RowPlan:
    """The slices of the ready sequences `seqs` (each with `slot`, `block`, `mbe_start`)."""
    plan = RowPlan([], [], [], [], [])
    for s in seqs:
        if s.mbe_start is not None:
            lo, hi = s.mbe_start * K, (s.block + 1) * K
            plan.q_start.append(lo if cache is not None else 0)
            plan.clamp.append(s.mbe_start)
        else:
            lo, hi = s.block * K, (s.block + 1) * K
            plan.q_start.append(cache.lengths[s.slot] if cache is not None else 0)
            plan.clamp.append(None)
        plan.q_end.append(hi)
        plan.t_start.append(lo)
        plan.t_len.append(hi - lo)
    return plan


def run_model(model, canvas: torch.Tensor, slots: list[int], plan: RowPlan, cache, K: int, mask_id: int):
    """Hidden states (b, L, H) of one forward over the canvas rows `slots` laid out by `plan`."""
    S = max(cache.lengths[r] for r in slots) if cache is not None else 0
    lay = build_layout(canvas[slots], plan.q_start, plan.q_end, K, plan.clamp, S, mask_id)
    lens = [e - s for s, e in zip(plan.q_start, plan.q_end)]
    # rows of unequal slices (a sequence just admitted runs its prompt blocks too): the padding skips the MLP
    ragged = min(lens) < max(lens)
    out = model(lay.input_ids, attention_mask=lay.keep, position_ids=lay.position_ids, cache=cache,
                cache_rows=slots if cache is not None else None, return_logits=False,
                token_mask=lay.valid if ragged else None)
    return out.last_hidden_state


def row_candidates(model, hidden: torch.Tensor, canvas: torch.Tensor, slots: list[int], plan: RowPlan, gens: list,
                   cfg, mask_id: int, lev_ids) -> list[tuple]:
    """(tok (t_len,) long, prob (t_len,) fp32, eprob (t_len, 2) fp32 or None) for every row of the forward.

    gens: per row, its generator (None when greedy). cfg: one `DecodeConfig` for every row, or a list with each
    row's own (requests with different settings share the forward). lev_ids: (DELETE id, INSERT id) when
    Levenshtein editing is on, or a list with each row's (None where off): their probabilities are priced from the
    logits, then they are kept out of the written tokens. The LM head runs once per target length; candidates are
    drawn per group of rows that sample alike (greedy or not, top-k, top-p, penalty; each sampled row at its own
    temperature). A row's candidates depend only on its own hidden states, settings and generator.
    """
    n = len(slots)
    cfgs = list(cfg) if isinstance(cfg, (list, tuple)) else [cfg] * n
    levs = list(lev_ids) if isinstance(lev_ids, list) else [lev_ids] * n
    results: list[tuple | None] = [None] * n
    for length in sorted(set(plan.t_len)):
        members = [i for i, tl in enumerate(plan.t_len) if tl == length]
        h = gather_span(hidden[members], [plan.t_start[i] - plan.q_start[i] for i in members], length)
        logits = model.lm_head(h).float()
        # design choice: a written token is never <|mask|> (a trained model gives it ~0 probability; an
        # untrained one would otherwise "fill" a mask with a mask and stall the block)
        logits[..., mask_id] = float("-inf")
        groups: dict = {}
        for j, i in enumerate(members):
            c = cfgs[i]
            groups.setdefault((c.temperature == 0, c.top_k, c.top_p, c.repetition_penalty, levs[i]), []).append(j)
        for (_, top_k, top_p, penalty, lev), rows in groups.items():
            _group_candidates(logits[rows], canvas, slots, plan, gens, cfgs, mask_id, lev,
                              [members[j] for j in rows], length, results, top_k, top_p, penalty)
    return results


def _group_candidates(logits, canvas, slots, plan, gens, cfgs, mask_id, lev_ids, members, length, results,
                      top_k, top_p, penalty):
    """Candidates of the rows `members` (one target length, one sampling rule) from their logits into `results`."""
    dev = logits.device
    eprob = None
    if lev_ids is not None:
        eprob = edit_probs(logits, *lev_ids)
        logits[..., list(lev_ids)] = float("-inf")
    suppress = None
    if penalty:
        pos = torch.tensor([plan.t_start[i] for i in members], device=dev)[:, None] + torch.arange(length, device=dev)
        member_rows = torch.tensor([slots[i] for i in members], device=dev)
        prev = canvas[member_rows[:, None], (pos - 1).clamp(min=0)].masked_fill(pos == 0, mask_id)
        suppress = penalty_targets(prev, mask_id)
    temps = [cfgs[i].temperature for i in members]
    if len(set(temps)) == 1:
        g = [gens[i] for i in members] if temps[0] > 0 else None
        tok, prob = candidates(logits, temps[0], top_k, top_p, g, suppress, penalty)
    else:  # sampled rows at their own temperatures: the same maths as one temperature per call
        tok, prob = candidates_at_temperatures(logits, temps, top_k, top_p, [gens[i] for i in members], suppress,
                                               penalty)
    for j, i in enumerate(members):
        results[i] = (tok[j], prob[j], None if eprob is None else eprob[j])
