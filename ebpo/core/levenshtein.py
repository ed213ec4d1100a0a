"""Levenshtein editing inside a block (LLaDA2.2): LCS edit labels of a draft against a target, and their application.

Four operations per position (op codes below): KEEP, SUB (write a token; filling a [MASK] is a SUB), DEL
(remove x_i, the tokens after it shift left) and INS (x_i becomes ([MASK], x_i), so that a later round fills
the new slot). After a round the block is padded with [MASK] at the tail, or cut there, to keep its length K.

Labels (`lcs_labels`), as the LLaDA2.2 report describes them (docs/background.md, section "Levenshtein
editing", gives the choices where it is silent):

* an LCS of draft x and target y (both of length K) gives the anchors; a [MASK] in x matches any target token;
* in the gap before an anchor, draft and target positions are paired in order: paired draft positions are
  labelled SUB (with their target token), surplus draft positions DEL, and a gap in which the target has more
  tokens gives one INS to the anchor after it (one insert per gap per round: later rounds create the rest);
* an anchor is labelled KEEP (SUB with its target token when it is a [MASK]) unless it is an insertion site;
* every draft position after the last anchor is DEL, and so is every position when there is no anchor.

Tie-breaking of the alignment (the report says only that a masked position gets "the nearest feasible target
index"): walking left to right through an optimal alignment, a token is matched as soon as matching is optimal;
a [MASK] whose current target index lies before its own position skips that target when skipping stays optimal
(so it lands nearer its own index); when only skips are optimal, the one that brings the target index nearer the
draft index is taken (the draft one on a tie).

With the labels' length bookkeeping (#DEL >= #INS in every round, see `lcs_labels`) the block never overflows:
a round only pads. Everything is batched torch over N blocks: the LCS table is K row updates (a reverse cummax
each), the walk 2K gathers; no Python loop over blocks.
"""
from __future__ import annotations

import torch

KEEP, SUB, DEL, INS = 0, 1, 2, 3
OP_NAMES = ("keep", "sub", "del", "ins")


def _lcs_table(match: torch.Tensor) -> torch.Tensor:
    """Suffix LCS lengths D (N, K+1, K+1) long: D[n, i, j] = LCS of x[i:] and y[j:] under `match` (N, K, K) bool.

    Row update: a_j = max(D[i+1, j], match_ij * (D[i+1, j+1] + 1)); D[i, j] = max over j' >= j of a_j'.
    """
    N, K, _ = match.shape
    D = torch.zeros(N, K + 1, K + 1, dtype=torch.long, device=match.device)
    for i in range(K - 1, -1, -1):
        below = D[:, i + 1]
        a = torch.maximum(below[:, :K], torch.where(match[:, i], below[:, 1:] + 1, torch.zeros_like(below[:, 1:])))
        D[:, i, :K] = a.flip(-1).cummax(-1).values.flip(-1)
    return D


def alignment(draft: torch.Tensor, target: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Anchors of the LCS alignment: (N, K) long, for each draft position the matched target index or -1.

    draft, target (N, K) long; a draft [MASK] matches any target token. Tie-breaking: module docstring.
    """
    N, K = draft.shape
    dev = draft.device
    is_mask = draft == mask_id
    match = (draft[:, :, None] == target[:, None, :]) | is_mask[:, :, None]
    D = _lcs_table(match)
    flat = D.view(N, -1)
    W = K + 1
    rows = torch.arange(N, device=dev)
    i = torch.zeros(N, dtype=torch.long, device=dev)
    j = torch.zeros(N, dtype=torch.long, device=dev)
    anchor = torch.full((N, K), -1, dtype=torch.long, device=dev)
    for _ in range(2 * K):
        live = (i < K) & (j < K)
        if not bool(live.any()):
            break
        ic, jc = i.clamp(max=K - 1), j.clamp(max=K - 1)
        here = flat.gather(1, (i * W + j)[:, None]).squeeze(1)
        diag = flat.gather(1, ((i + 1).clamp(max=K) * W + (j + 1).clamp(max=K))[:, None]).squeeze(1)
        down = flat.gather(1, ((i + 1).clamp(max=K) * W + j)[:, None]).squeeze(1)  # skip the draft position
        right = flat.gather(1, (i * W + (j + 1).clamp(max=K))[:, None]).squeeze(1)  # skip the target position
        m = match[rows, ic, jc] & (here == diag + 1)
        skip_d, skip_t = down == here, right == here
        mask_here = is_mask[rows, ic]
        # a [MASK] behind its own index moves its target nearer when that stays optimal
        nearer = mask_here & (j < i) & skip_t
        take = live & m & ~nearer
        # only skips: the one that brings j nearer i (draft skip on a tie, or when it is the only optimal one)
        pick_t = live & ~take & (nearer | (skip_t & (~skip_d | (j < i))))
        pick_d = live & ~take & ~pick_t
        anchor[rows[take], ic[take]] = jc[take]
        i = i + (take | pick_d).long()
        j = j + (take | pick_t).long()
    return anchor


def labels_from_anchors(draft: torch.Tensor, target: torch.Tensor, anchor: torch.Tensor, mask_id: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ops (N, K) long op codes, toks (N, K) long) of the rules in the module docstring.

    toks: the token the position is written with under SUB (its target token), x_i under KEEP / DEL / INS.
    """
    N, K = draft.shape
    dev = draft.device
    pos = torch.arange(K, device=dev).expand(N, K)
    is_anchor = anchor >= 0
    # target index of the last anchor at or before i (-1 if none), and draft index of it
    j_prev_incl = torch.where(is_anchor, anchor, torch.full_like(anchor, -1)).cummax(-1).values
    i_prev_incl = torch.where(is_anchor, pos, torch.full_like(pos, -1)).cummax(-1).values
    j_prev = torch.cat([torch.full((N, 1), -1, device=dev, dtype=torch.long), j_prev_incl[:, :-1]], 1)
    i_prev = torch.cat([torch.full((N, 1), -1, device=dev, dtype=torch.long), i_prev_incl[:, :-1]], 1)
    # target index of the first anchor at or after i (K if none): which gap a free draft position lies in
    big = torch.full_like(anchor, K)
    j_next = torch.where(is_anchor, anchor, big).flip(-1).cummin(-1).values.flip(-1)
    trailing = j_next == K  # after the last anchor (or no anchor at all)
    rank = pos - i_prev - 1  # index of a free position inside its gap
    q = j_next - j_prev - 1  # target tokens in the gap
    free_sub = ~is_anchor & ~trailing & (rank < q)
    free_del = ~is_anchor & (trailing | (rank >= q))
    # an anchor is an insertion site when its gap has more target than draft tokens
    gap_p, gap_q = pos - i_prev - 1, anchor - j_prev - 1
    ins = is_anchor & (gap_q > gap_p)
    anchor_fill = is_anchor & ~ins & (draft == mask_id)
    ops = torch.full_like(draft, KEEP)
    ops = torch.where(free_sub | anchor_fill, torch.full_like(ops, SUB), ops)
    ops = torch.where(free_del, torch.full_like(ops, DEL), ops)
    ops = torch.where(ins, torch.full_like(ops, INS), ops)
    tj = torch.where(free_sub, j_prev + 1 + rank, anchor).clamp(0, K - 1)
    toks = torch.where(ops == SUB, target.gather(1, tj), draft)
    return ops, toks


def lcs_labels(draft: torch.Tensor, target: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Edit labels of N blocks: (ops (N, K) long, toks (N, K) long); see `labels_from_anchors`.

    draft (N, K) long may hold [MASK]; target (N, K) long. #DEL >= #INS in every row (each INS answers a gap
    with more target than draft tokens, and the surplus draft tokens of the other gaps and the trailing ones,
    all DEL, balance them), so `apply_ops` only ever pads.
    """
    if draft.shape != target.shape or draft.dim() != 2:
        raise ValueError(f"lcs_labels: draft and target must both be (N, K), got {tuple(draft.shape)} and "
                         f"{tuple(target.shape)}")
    return labels_from_anchors(draft, target, alignment(draft, target, mask_id), mask_id)


def label_ids(ops: torch.Tensor, toks: torch.Tensor, delete_id: int, insert_id: int) -> torch.Tensor:
    """(N, K) long: the token the model is trained to predict at each position: x_i (KEEP), the target token
    (SUB), `delete_id` (DEL) or `insert_id` (INS); the action space is the vocabulary with DELETE and INSERT."""
    out = torch.where(ops == DEL, torch.full_like(toks, delete_id), toks)
    return torch.where(ops == INS, torch.full_like(toks, insert_id), out)


def ops_from_ids(pred: torch.Tensor, cur: torch.Tensor, delete_id: int, insert_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `label_ids` for a block `cur` (N, K) and predicted ids `pred` (N, K): (ops, toks)."""
    ops = torch.where(pred == cur, torch.full_like(pred, KEEP), torch.full_like(pred, SUB))
    ops = torch.where(pred == delete_id, torch.full_like(ops, DEL), ops)
    ops = torch.where(pred == insert_id, torch.full_like(ops, INS), ops)
    return ops, torch.where((ops == DEL) | (ops == INS), cur, pred)


def apply_ops(block: torch.Tensor, ops: torch.Tensor, toks: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The block after one round of edits, (N, K) long, padded with [MASK] at the tail or cut there.

    block (N, K): x; ops (N, K) op codes; toks (N, K): the written token where ops == SUB. Position i emits
    nothing (DEL), x_i (KEEP), toks_i (SUB) or ([MASK], x_i) (INS), in order.
    """
    N, K = block.shape
    dev = block.device
    count = torch.where(ops == DEL, 0, torch.where(ops == INS, 2, 1))
    end = count.cumsum(-1)  # one past each position's last emitted slot
    tok = torch.where(ops == SUB, toks, block)
    out = torch.full((N, 2 * K + 1), mask_id, dtype=block.dtype, device=dev)
    last = torch.where(count > 0, end - 1, torch.full_like(end, 2 * K))  # DEL writes into the spare slot
    out.scatter_(1, last, tok)
    # INS: the slot before x_i already holds [MASK] unless an earlier write put a token there; slots are
    # distinct per position, so nothing else can land on it
    return out[:, :K]


def apply_labels(block: torch.Tensor, target: torch.Tensor, mask_id: int) -> torch.Tensor:
    """One label round: `apply_ops(block, *lcs_labels(block, target))` (N, K) long."""
    ops, toks = lcs_labels(block, target, mask_id)
    return apply_ops(block, ops, toks, mask_id)


def rounds_to_target(draft: torch.Tensor, target: torch.Tensor, mask_id: int, max_rounds: int) -> torch.Tensor:
    """(N,) long: label rounds until each block equals its target (max_rounds + 1 if it never does)."""
    cur = draft.clone()
    done_at = torch.full((draft.shape[0],), max_rounds + 1, dtype=torch.long, device=draft.device)
    done_at[(cur == target).all(-1)] = 0
    for r in range(1, max_rounds + 1):
        cur = apply_labels(cur, target, mask_id)
        newly = (cur == target).all(-1) & (done_at > max_rounds)
        done_at[newly] = r
    return done_at
