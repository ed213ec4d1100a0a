"""SFT with Levenshtein rounds (LLaDA2.2): teach DELETE / INSERT from LCS edit labels of drafts against the target.

The first round is the ordinary M2T + T2T (+ MTF) mixture (`ebpo.core.objectives`, target supervision). Each
Levenshtein round then takes a draft of the response, cuts it into the blocks of the layout, labels every block
against its target block with `ebpo.core.levenshtein.lcs_labels` (a draft [MASK] matches any target token) and
runs one `[draft ; clean]` forward whose loss is the cross-entropy of the label ids at the response positions:
x_i (keep, weighted by `keep_weight` like the T2T keep term), the target token (substitute or fill), DELETE or
INSERT. The next round's draft is this draft after the model's own edits (no gradient), so later rounds see the
states the decoder meets and recompute the labels from them. Which edits is the caller's `next_draft`: by default
(None) the argmax at every editable position (`ops_from_ids` + `apply_ops`: every position rewritten, every
DELETE / INSERT argmax applied); `ebpo.sft.lev_draft` passes one that applies the decoder's thresholds instead
(one block step of `rollout.levenshtein` per block, with the recipe's tau_mask, tau_edit, tau_delete, tau_insert,
max_lev_edits). Each block of the draft is then one active block of the decoder: the `[draft ; clean]` forward
shows it the target's earlier blocks, as the decoder shows it the committed ones.

Drafts of the first Levenshtein round (`lev_source`):

* `corrupt`: the target with length errors: in each block, one corruption with probability `lev_rate`, a second
  with probability `lev_rate ** 2`, each an inserted random token, a deleted token or a duplicated token (a
  repeat, the error of an n-gram loop), then each position masked with a block-level probability drawn from
  U[0, 0.5) (the decoder's drafts still hold masks when it edits);
* `model`: the first round's own draft (its argmax at the masks over the T2T-noised visible tokens);
* `mixed`: per row, either with probability 1/2.

Corruptions touch response positions only; a block's prompt tokens, identical in draft and target, are LCS
anchors and are labelled keep, and they carry no loss. Randomness comes only from the generator passed in.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ebpo.core.levenshtein import apply_ops, label_ids, lcs_labels, ops_from_ids

LEV_SOURCES = ("corrupt", "model", "mixed")

# (draft (B, L) long, logits (N, V) fp32 of the N editable positions in row-major order, detached, editable (B, L)
# bool, block size K) -> the next round's draft (B, L) long; it must leave the non-editable positions as they are
NextDraft = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def corrupt_blocks(clean: torch.Tensor, editable: torch.Tensor, block_size: int, mask_id: int, rate: float,
                   allowed_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(B, L) long drafts with insert / delete / duplicate corruptions (module docstring) inside each block.

    clean (B, L) long, L a multiple of block_size; editable (B, L) bool: the response positions (in each block a
    suffix of it: the prompt comes first). A block's editable segment is corrupted, padded with [MASK] or cut
    back to its length, then partly masked.
    """
    B, L = clean.shape
    K = block_size
    nb = L // K
    out = clean.clone()
    u = torch.rand(B, nb, 8, generator=generator, device=generator.device).tolist()
    picks = torch.randint(0, len(allowed_ids), (B, nb, 2), generator=generator, device=generator.device).tolist()
    mask_coins = torch.rand(B, L, generator=generator, device=generator.device)
    mask_level = torch.rand(B, nb, generator=generator, device=generator.device) * 0.5
    ed = editable.tolist()
    rows = clean.tolist()
    for b in range(B):
        for k in range(nb):
            lo = next((i for i in range(k * K, (k + 1) * K) if ed[b][i]), None)
            if lo is None:
                continue
            hi = (k + 1) * K
            seg = rows[b][lo:hi]
            n = len(seg)
            r = u[b][k]
            for c in range((r[0] < rate) + (r[0] < rate ** 2)):
                kind, at = int(r[1 + 2 * c] * 3), int(r[2 + 2 * c] * max(len(seg), 1))
                if kind == 0:
                    seg.insert(at, int(allowed_ids[picks[b][k][c]]))
                elif kind == 1 and seg:
                    seg.pop(min(at, len(seg) - 1))
                elif seg:
                    at = min(at, len(seg) - 1)
                    seg.insert(at, seg[at])
            seg = (seg + [mask_id] * n)[:n]
            out[b, lo:hi] = torch.tensor(seg, dtype=out.dtype, device=out.device)
        hide = editable[b] & (mask_coins[b] < mask_level[b].repeat_interleave(K))
        out[b] = out[b].masked_fill(hide, mask_id)
    return out


def block_labels(draft: torch.Tensor, clean: torch.Tensor, block_size: int, mask_id: int, delete_id: int,
                 insert_id: int) -> torch.Tensor:
    """(B, L) long label ids of every block of `draft` against `clean` (both (B, L), L a multiple of K)."""
    B, L = draft.shape
    ops, toks = lcs_labels(draft.reshape(-1, block_size), clean.reshape(-1, block_size), mask_id)
    return label_ids(ops, toks, delete_id, insert_id).view(B, L)


def apply_predictions(draft: torch.Tensor, pred: torch.Tensor, block_size: int, mask_id: int, delete_id: int,
                      insert_id: int, editable: torch.Tensor) -> torch.Tensor:
    """(B, L): `draft` after the edits that `pred` (B, L) ids encode, block by block; fixed positions stay."""
    B, L = draft.shape
    pred = torch.where(editable, pred, draft)
    ops, toks = ops_from_ids(pred.reshape(-1, block_size), draft.reshape(-1, block_size), delete_id, insert_id)
    return apply_ops(draft.reshape(-1, block_size), ops, toks, mask_id).reshape(B, L)


def lev_round(model, lm_head, draft, clean, editable, block_size, mask_id, delete_id, insert_id, keep_weight,
              edit_weight=1.0):
    """One Levenshtein round: (loss scalar, metrics, predicted ids (B, L) detached).

    loss = sum over editable positions of w_i * CE(label_i) / number of editable positions, w = keep_weight where
    the label is keep (the draft's own token), edit_weight where it is DELETE or INSERT, 1 elsewhere.
    """
    loss, metrics, pred, _ = _lev_round(model, lm_head, draft, clean, editable, block_size, mask_id, delete_id,
                                        insert_id, keep_weight, edit_weight)
    return loss, metrics, pred


def _lev_round(model, lm_head, draft, clean, editable, block_size, mask_id, delete_id, insert_id, keep_weight,
               edit_weight):
    """`lev_round`, plus the detached fp32 logits (N, V) of the N editable positions (row-major), for `next_draft`."""
    from ebpo.core.objectives import noisy_half_hidden

    labels = block_labels(draft, clean, block_size, mask_id, delete_id, insert_id)
    hidden = noisy_half_hidden(model, draft, clean, block_size)
    logits = lm_head(hidden[editable]).float()
    target = labels[editable]
    keep = target == draft[editable]
    w = torch.where(keep, torch.full_like(target, 0, dtype=logits.dtype) + keep_weight, torch.ones_like(logits[:, 0]))
    w = torch.where((target == delete_id) | (target == insert_id), torch.full_like(w, edit_weight), w)
    n = max(int(editable.sum()), 1)
    loss = (F.cross_entropy(logits, target, reduction="none") * w).sum() / n if target.numel() else logits.sum() * 0
    with torch.no_grad():
        pl = logits.detach().clone()
        pl[:, mask_id] = float("-inf")
        p = pl.argmax(-1)
        pred = draft.clone()
        pred[editable] = p
        is_del, is_ins = target == delete_id, target == insert_id
        metrics = {"lev_deletes": float(is_del.sum()), "lev_inserts": float(is_ins.sum()),
                   "lev_acc_edit": float((p[is_del | is_ins] == target[is_del | is_ins]).float().mean())
                   if bool((is_del | is_ins).any()) else float("nan")}
    return loss, metrics, pred, logits.detach()


def levenshtein_loss(model, lm_head, clean: torch.Tensor, response_mask: torch.Tensor, first_draft: torch.Tensor,
                     cfg, block_size: int, mask_id: int, delete_id: int, insert_id: int, allowed_ids: torch.Tensor,
                     generator: torch.Generator, next_draft: Optional[NextDraft] = None) -> tuple[torch.Tensor, dict]:
    """Mean loss of `cfg.lev_rounds` Levenshtein rounds (module docstring) and `loss/lev*` metrics.

    clean, response_mask (B, L); first_draft (B, L): the first round's draft (`mixture_loss`'s third output);
    cfg: the `ObjectiveConfig` (lev_source, lev_rate, lev_rounds, lev_fraction, keep_weight).
    next_draft: builds each later round's draft from this round's (`NextDraft`: draft (B', L), detached fp32
    logits (N, V) of its N editable positions, editable (B', L) bool, block_size -> (B', L) long; B' the rows
    that take the rounds); None = the argmax at every editable position (`apply_predictions`). It runs under
    no_grad and draws nothing from `generator`, so the rounds' randomness is the same either way.
    """
    B = clean.shape[0]
    n_rows = max(1, round(cfg.lev_fraction * B))
    clean, editable, first = clean[:n_rows], response_mask[:n_rows].bool(), first_draft[:n_rows].detach()
    dev = clean.device
    corrupt = corrupt_blocks(clean.cpu(), editable.cpu(), block_size, mask_id, cfg.lev_rate, allowed_ids.cpu(),
                             generator).to(dev)
    if cfg.lev_source == "corrupt":
        draft = corrupt
    elif cfg.lev_source == "model":
        draft = first
    else:
        coin = (torch.rand(n_rows, generator=generator, device=generator.device) < 0.5).to(dev)[:, None]
        draft = torch.where(coin, corrupt, first)
    total = clean.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for r in range(cfg.lev_rounds):
        loss, m, pred, logits = _lev_round(model, lm_head, draft, clean, editable, block_size, mask_id, delete_id,
                                           insert_id, cfg.keep_weight, cfg.lev_edit_weight)
        total = total + loss / cfg.lev_rounds
        metrics[f"loss/lev_round{r + 1}"] = float(loss.detach())
        for k, v in m.items():
            metrics[f"lev/{k}_round{r + 1}"] = v
        if r + 1 == cfg.lev_rounds:  # the last round's edits would feed no round (and draw nothing: skipping is exact)
            break
        if next_draft is None:
            draft = apply_predictions(draft, pred, block_size, mask_id, delete_id, insert_id, editable)
        else:
            with torch.no_grad():
                draft = next_draft(draft, logits, editable, block_size)
    metrics["loss/lev"] = float(total.detach())
    return total, metrics
