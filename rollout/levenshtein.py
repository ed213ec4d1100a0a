"""Levenshtein editing in the decoder (LLaDA2.2): DELETE and INSERT inside the active block. Pure, batched, no model.

At every block step the model's distribution at position i also prices the two edit-control tokens:
p(DELETE) > tau_delete removes x_i (the tokens after it shift left), p(INSERT) > tau_insert turns x_i into
([MASK], x_i). At most `max_lev_edits` such operations run per block and round (the most confident ones), on
generated positions only; a position that takes one is neither filled (M2T) nor rewritten (T2T) this round.
An operation on a [MASK] is allowed: deleting it pulls the tokens after it left, inserting before it pushes them
right, as the LCS labels that SFT trains on ask (`ebpo.core.levenshtein`). Only a [MASK] followed by nothing but
[MASK]s to the block's end is a no-op there, and takes no operation. From a block's forward cap on
(`K + max_post_steps + 1` forwards) DELETE and INSERT are off in that block, and the block ends only once it holds
no [MASK]: a shift can open a slot at the cap, and the plain fill then closes it (at least one per forward), so
no [MASK] is ever committed.
The other positions go through the ordinary draft-and-edit step, with the edit-control tokens excluded from
its candidates (a written token is never DELETE or INSERT). The block is then rebuilt by
`ebpo.core.levenshtein.apply_ops`: padded with [MASK] at the tail, or cut there, so its length stays K.

Shifts stay inside the active block: the prompt's positions come first in it and never move, and the blocks
before it (the only ones in the prefix KV cache) are untouched, so the cache stays valid. The edit probabilities
are read from the logits, not sampled: no generator draw is added, and a sequence's samples stay independent
of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ebpo.core.levenshtein import DEL, INS, KEEP, SUB, apply_ops

from .steps import StepResult, block_step

__all__ = ["DEL", "INS", "LevStep", "edit_probs", "edit_sets", "lev_log", "levenshtein_block_step", "shift_trace"]


@dataclass
class LevStep:
    """One block step with Levenshtein operations, for B blocks of K positions.

    result: the `StepResult` after the shifts (m2t / t2t are the pre-shift positions written by the ordinary
        step; t2t also marks the DELETE / INSERT positions, so that the block-end rule counts them as edits).
    ops: (B, K) op codes of `ebpo.core.levenshtein` at the pre-shift positions.
    filled / rewritten: (B, K) bool, post-shift positions holding a token written this round by M2T / by T2T.
    tokens: (B, K) long, the ordinary step's block before the shifts (the token a T2T rewrite wrote).
    """

    result: StepResult
    ops: torch.Tensor
    filled: torch.Tensor
    rewritten: torch.Tensor
    tokens: torch.Tensor

    @property
    def written(self) -> torch.Tensor:
        """(B, K) bool: post-shift positions written this round."""
        return self.filled | self.rewritten


def edit_probs(logits: torch.Tensor, delete_id: int, insert_id: int) -> torch.Tensor:
    """(..., 2) fp32: p(DELETE), p(INSERT) under softmax(logits) (..., V); the caller then masks those logits."""
    return logits.float().softmax(-1)[..., [delete_id, insert_id]]


def edit_sets(eprob: torch.Tensor, protected: torch.Tensor, tau_delete: float | None, tau_insert: float | None,
              max_edits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(delete (B, K) bool, insert (B, K) bool): where an edit-control token beats its threshold (strict),
    never on `protected` positions, at most one operation per position (the likelier), at most `max_edits` per
    row (the most confident). A threshold None or negative switches that operation off."""
    B, K, _ = eprob.shape
    neg = torch.full_like(eprob[..., 0], -1.0)
    pd = eprob[..., 0] if tau_delete is not None and tau_delete >= 0 else neg
    pi = eprob[..., 1] if tau_insert is not None and tau_insert >= 0 else neg
    want_d = (pd > (tau_delete or 0.0)) & (pd >= pi) & ~protected
    want_i = (pi > (tau_insert or 0.0)) & (pi > pd) & ~protected
    conf = torch.where(want_d, pd, torch.where(want_i, pi, torch.full_like(pd, float("-inf"))))
    order = conf.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(K, device=order.device).expand_as(order))
    keep = rank < max_edits
    return want_d & keep, want_i & keep


def noop_positions(cur: torch.Tensor, mask_id: int) -> torch.Tensor:
    """(B, K) bool: [MASK] positions followed by nothing but [MASK]s to the block's end, where DELETE / INSERT
    change nothing (deleting one pads another at the tail; inserting before one cuts one from the tail)."""
    is_mask = (cur == mask_id).long()
    return is_mask.flip(-1).cumprod(-1).flip(-1).bool()


def levenshtein_block_step(tok, prob, eprob, cur, protected, mask_id: int, cfg,
                           ops_allowed: torch.Tensor | None = None) -> LevStep:
    """The draft-and-edit step of `rollout.steps.block_step` with DELETE / INSERT added (module docstring).

    tok, prob: (B, K) candidates drawn with the edit-control tokens excluded; eprob (B, K, 2) from `edit_probs`;
    cur, protected (B, K) as in `block_step`; cfg: the `DecodeConfig` (tau_mask, tau_edit, num_to_transfer,
    tau_delete, tau_insert, max_lev_edits); ops_allowed: (B,) bool, False for blocks past their forward cap
    (no operation there).
    """
    blocked = protected | noop_positions(cur, mask_id)
    if ops_allowed is not None:
        blocked = blocked | ~ops_allowed[:, None]
    dele, ins = edit_sets(eprob, blocked, cfg.tau_delete, cfg.tau_insert, cfg.max_lev_edits)
    base = block_step(tok, prob, cur, protected | dele | ins, mask_id, cfg.tau_mask, cfg.tau_edit,
                      cfg.num_to_transfer)
    ops = torch.where(dele, DEL, torch.where(ins, INS, torch.where(base.m2t | base.t2t, SUB, KEEP)))
    new = apply_ops(cur, ops, base.new, mask_id)

    def moved(flag):  # where the positions flagged before the shift are after it
        return apply_ops(flag.long(), ops, flag.long(), 0) == 1
    is_mask = (cur == mask_id) & ~protected
    res = StepResult(new=new, m2t=base.m2t, t2t=base.t2t | dele | ins, had_masks=is_mask.any(-1),
                     masks_left=((new == mask_id) & ~protected).sum(-1))
    return LevStep(result=res, ops=ops, filled=moved(base.m2t), rewritten=moved(base.t2t), tokens=base.new)


def shift_trace(trace: torch.Tensor, step: LevStep, forward: torch.Tensor) -> torch.Tensor:
    """Trace (B, K) long after the step: each token keeps the forward that wrote it as it moves, inserted and tail
    [MASK] slots get -1, tokens written this round get `forward` ((B, 1) long)."""
    moved = apply_ops(trace, step.ops, trace, -1)
    return torch.where(step.written, forward, moved)


def lev_log(step: LevStep, row: int, pos: torch.Tensor, cur: torch.Tensor, prompt_len: int, delete_id: int,
            insert_id: int) -> list[tuple[int, int, int]]:
    """Edit-log entries of row `row`: (offset from the prompt's end, old token, new token) for every T2T rewrite,
    (offset, old, DELETE id) / (offset, old, INSERT id) for the operations; offsets are pre-shift positions."""
    ops, t2t = step.ops[row], step.result.t2t[row] & (step.ops[row] == SUB)
    out = []
    for i in (t2t | (ops == DEL) | (ops == INS)).nonzero().flatten().tolist():
        op = int(ops[i])
        new = delete_id if op == DEL else insert_id if op == INS else int(step.tokens[row, i])
        out.append((int(pos[i]) - prompt_len, int(cur[i]), new))
    return out
