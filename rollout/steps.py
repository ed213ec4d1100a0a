"""Pure, batched step functions of draft-and-edit decoding (docs/background.md section 3). No model calls.

All tensors are per active block: (B, K) for B sequences and block size K. `cur` holds the block's
tokens at the start of the iteration, `tok`/`prob` the candidates of this iteration's forward,
`protected` marks prompt positions (never filled, never edited).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    """Outcome of one iteration for a batch of blocks; all (B, K) bool/long or (B,) long."""

    new: torch.Tensor  # (B, K) tokens after writing Gamma union Delta
    m2t: torch.Tensor  # (B, K) bool: Gamma, masks filled this iteration
    t2t: torch.Tensor  # (B, K) bool: Delta, visible tokens edited this iteration
    had_masks: torch.Tensor  # (B,) bool: the block held masks at the start of the iteration
    masks_left: torch.Tensor  # (B,) long: masks remaining after the write


def m2t_set(prob: torch.Tensor, is_mask: torch.Tensor, tau_mask: float, num_to_transfer: int) -> torch.Tensor:
    """Gamma (B, K) bool: masks with prob > tau_mask; if fewer than `num_to_transfer` pass, the
    `num_to_transfer` most confident masks instead (all of them when fewer remain)."""
    passing = is_mask & (prob > tau_mask)
    conf = prob.masked_fill(~is_mask, float("-inf"))
    order = conf.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    fallback = is_mask & (rank < num_to_transfer)
    use_fallback = (passing.sum(-1) < num_to_transfer)[:, None]
    return torch.where(use_fallback, fallback, passing)


def t2t_set(tok: torch.Tensor, prob: torch.Tensor, cur: torch.Tensor, is_mask: torch.Tensor,
            protected: torch.Tensor, tau_edit: float | None) -> torch.Tensor:
    """Delta (B, K) bool: visible (not mask at the iteration start), not prompt, tok != cur, prob > tau_edit.

    tau_edit None or negative: editing off (all False).
    """
    if tau_edit is None or tau_edit < 0:
        return torch.zeros_like(is_mask)
    return ~is_mask & ~protected & (tok != cur) & (prob > tau_edit)


def block_step(tok: torch.Tensor, prob: torch.Tensor, cur: torch.Tensor, protected: torch.Tensor, mask_id: int,
               tau_mask: float, tau_edit: float | None, num_to_transfer: int) -> StepResult:
    """One draft-and-edit iteration: M2T and T2T from the same candidates, then write both sets.

    tok, prob, cur, protected: (B, K). Prompt positions are excluded from both sets (a mask id inside
    the prompt is left alone).
    """
    is_mask = (cur == mask_id) & ~protected
    m2t = m2t_set(prob, is_mask, tau_mask, num_to_transfer)
    t2t = t2t_set(tok, prob, cur, is_mask, protected, tau_edit)
    new = torch.where(m2t | t2t, tok, cur)
    masks_left = ((new == mask_id) & ~protected).sum(-1)
    return StepResult(new=new, m2t=m2t, t2t=t2t, had_masks=is_mask.any(-1), masks_left=masks_left)


def block_done(res: StepResult, post_steps: torch.Tensor, block_iters: torch.Tensor, max_post_steps: int,
               block_cap: int, editing: bool, prob: torch.Tensor | None = None,
               early_commit: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-end rule (docs/background.md section 3, step 5). Returns (done (B,) bool, post_steps (B,) long).

    post_steps / block_iters: (B,) long counts *including* this iteration's forward in block_iters.
    An iteration that starts with no masks is a post-step. The block ends when
      - a post-step makes no edit, or
      - no masks remain and `max_post_steps` post-steps have been taken (0 = end as soon as the block is
        full), or
      - no masks remain and editing is off (a post-step could not edit, so it is not run), or
      - the block has used `block_cap` forwards (SGLang's K + max_post_steps + 1 safety cap), or
      - (early commit, off unless `early_commit` is a number; `prob` (B, K) the candidates' probabilities)
        this iteration filled the last masks, every token it filled has prob > early_commit and it edited
        nothing: the confirming post-step is skipped.
    """
    post = ~res.had_masks
    post_steps = post_steps + post.long()
    full = res.masks_left == 0
    edited = res.t2t.any(-1)
    done = (post & ~edited) | (full & (post_steps >= max_post_steps)) | (block_iters >= block_cap)
    if not editing:
        done = done | full
    if early_commit is not None:
        sure = prob.masked_fill(~res.m2t, float("inf")).amin(-1) > early_commit
        done = done | (res.had_masks & full & ~edited & sure)
    return done, post_steps


def mbe_edit_set(tok: torch.Tensor, prob: torch.Tensor, cur: torch.Tensor, editable: torch.Tensor,
                 tau: float) -> torch.Tensor:
    """Multi-Block Editing set (B, T) bool: editable window positions whose candidate differs with prob > tau."""
    return editable & (tok != cur) & (prob > tau)


def penalty_targets(prev_tokens: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Token to penalise at each position: the token now at position i-1 (-1 where that is a mask).

    prev_tokens (B, K): canvas[i - 1] for each block position i.
    """
    return prev_tokens.masked_fill(prev_tokens == mask_id, -1)


def first_eos(tokens: list[int], eos_ids: set[int]) -> int | None:
    """Index of the first EOS in `tokens`, or None."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return i
    return None
