"""CPT/SFT objectives for block diffusion: the M2T + T2T mixture, Multi-Turn Forward, vectorized blocks.

Layout (docs/background.md section 2): one forward over `[noisy ; clean]` (length 2L) with the keep-mask
`ebpo.model.masks.noisy_clean_mask(L, K)` and position ids `[0..L-1 ; 0..L-1]`. Noisy block b sees itself and
the clean blocks before it, so every block's denoising loss comes out of one forward; the loss is read
only on the noisy half. Right padding needs no mask: padding sits in blocks after every real token and
block-causal attention never lets an earlier block see a later one.

Loss terms (positions are response positions; `NoisyBatch` says which kind each one is):

* `m2t`     cross-entropy at the masked positions (predict the clean token);
* `restore` cross-entropy at the T2T-substituted positions (recover the original token);
* `keep`    cross-entropy at the visible unchanged positions (keep a correct token: without it the
            model's prediction at a visible position is untrained, and Speedy Mode, which edits whenever
            the argmax disagrees with the canvas, would rewrite correct tokens);
* `mtf`     Multi-Turn Forward: the first pass's own argmax predictions fill the masks, a second
            `[draft ; clean]` forward is supervised by the clean tokens at those positions, so the model
            learns to correct (or confirm) its own drafts, the errors it will meet when editing.

    loss = m2t + t2t_weight * (restore + keep_weight * keep) + mtf_weight * mtf

Normalisation (`normalize`): "token" divides each term's summed cross-entropy by its number of tokens in
the batch (dFactory's choice for M2T); "elbo" weights each masked token by 1/t_i and divides by the number
of response tokens (the linear-schedule ELBO, an unbiased estimate of the per-token NLL bound); the
restore/keep/mtf terms are always per token (they are not ELBO terms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ebpo.core.fields import doc
from ebpo.model.masks import noisy_clean_mask, noisy_clean_position_ids
from ebpo.core.noise import NoisyBatch


@dataclass(frozen=True)
class LossShard:
    """One rank's rows of a batch that several ranks share (data-parallel SFT).

    counts: the whole batch's denominators {"response", "masked", "substituted", "kept", "mtf_drafted"};
    mtf_rows: (b,) bool, which of this rank's rows are among the whole batch's MTF rows."""

    counts: dict
    mtf_rows: torch.Tensor


def shard_of(response_mask: torch.Tensor, nb: NoisyBatch, rows: torch.Tensor, mtf_fraction: float) -> LossShard:
    """The `LossShard` of `rows` (a (b,) long index) of a whole batch (response_mask (B, L), its noise `nb`)."""
    B = response_mask.shape[0]
    n_mtf = max(1, round(mtf_fraction * B))
    counts = {"response": int(response_mask.sum()), "masked": int(nb.masked.sum()),
              "substituted": int(nb.substituted.sum()), "kept": int(nb.kept.sum()),
              "mtf_drafted": int(nb.masked[:n_mtf].sum())}
    return LossShard(counts, rows < n_mtf)


def take_rows(nb: NoisyBatch, rows: torch.Tensor) -> NoisyBatch:
    """The noise of `rows` (a (b,) long index) of a batch."""
    return NoisyBatch(**{k: v[rows] for k, v in vars(nb).items()})


@dataclass
class ObjectiveConfig:
    t_min: float = doc("lowest M2T noise level (fraction of response tokens masked)", 0.1)
    t_max: float = doc("highest M2T noise level; levels are stratified across the batch", 1.0)
    min_one_mask: bool = doc("force at least one masked response token per example", True)
    t2t_rate: float = doc("fraction of the visible response tokens replaced by random tokens (0 = no T2T)", 0.15)
    t2t_weight: float = doc("weight of the T2T terms (restore + keep_weight * keep); 0 = no T2T stream", 1.0)
    keep_weight: float = doc("weight of the keep-correct-token term inside the T2T stream", 0.5)
    mtf_weight: float = doc("weight of the Multi-Turn Forward second pass (0 = off)", 0.5)
    mtf_fraction: float = doc("fraction of each batch's rows that get the MTF second pass", 0.5)
    normalize: Literal["token", "elbo"] = doc("M2T loss: per masked token, or ELBO (1/t weights, per response token)",
                                              "token")
    mbe_weight: float = doc("weight of the Multi-Block Editing window term (ebpo.core.mbe_objective: T2T restore "
                            "through an enlarged bidirectional window of mbe_window + 1 blocks); 0 = off", 0.0)
    mbe_window: int = doc("MBE window W of that term (the decoder's rollout.decode.mbe_window)", 1)
    lev_weight: float = doc("weight of the Levenshtein rounds (ebpo.core.lev_objective: LCS edit labels with DELETE / "
                            "INSERT; the model needs delete_token_id / insert_token_id); 0 = off", 0.0)
    lev_source: Literal["corrupt", "model", "mixed"] = doc(
        "drafts of the Levenshtein rounds: target corruptions (insert / delete / duplicate), the first round's own "
        "draft, or either per row", "mixed")
    lev_rate: float = doc("probability of a length corruption per block of a corrupt draft (a second: lev_rate^2)", 0.5)
    lev_rounds: int = doc("Levenshtein rounds after the first (each recomputes the labels from the model-edited "
                          "draft; one forward each)", 1)
    lev_fraction: float = doc("fraction of each batch's rows that get the Levenshtein rounds", 0.5)
    lev_edit_weight: float = doc("weight of the DELETE / INSERT labels in a Levenshtein round (rare next to keep "
                                 "and fill: a few per hundred positions)", 1.0)

    def validate(self):
        if not 0.0 < self.t_min <= self.t_max <= 1.0:
            raise ValueError(f"objective.t_min/t_max: need 0 < t_min <= t_max <= 1, got {self.t_min}, {self.t_max}")
        if not 0.0 <= self.t2t_rate < 1.0:
            raise ValueError(f"objective.t2t_rate: must lie in [0, 1), got {self.t2t_rate}")
        if not 0.0 <= self.mtf_fraction <= 1.0:
            raise ValueError(f"objective.mtf_fraction: must lie in [0, 1], got {self.mtf_fraction}")
        if self.mbe_weight > 0 and not (self.mbe_window >= 1 and 0.0 < self.t2t_rate < 1.0):
            raise ValueError(f"objective.mbe_window: needs mbe_window >= 1 and 0 < t2t_rate < 1 when mbe_weight > 0, "
                             f"got mbe_window={self.mbe_window}, t2t_rate={self.t2t_rate}")
        if self.lev_source not in ("corrupt", "model", "mixed"):
            raise ValueError(f"objective.lev_source: choose corrupt, model or mixed, got {self.lev_source!r}")
        if not (0.0 <= self.lev_rate <= 1.0 and 0.0 < self.lev_fraction <= 1.0 and self.lev_rounds >= 1):
            raise ValueError("objective.lev_rate / lev_fraction / lev_rounds: need lev_rate in [0, 1], lev_fraction in "
                             f"(0, 1], lev_rounds >= 1, got {self.lev_rate}, {self.lev_fraction}, {self.lev_rounds}")
        for name in ("t2t_weight", "keep_weight", "mtf_weight", "mbe_weight", "lev_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"objective.{name}: must be >= 0")


def noisy_half_hidden(model, noisy: torch.Tensor, clean: torch.Tensor, block_size: int) -> torch.Tensor:
    """Final hidden states (B, L, H) of the noisy half of one `[noisy ; clean]` forward.

    noisy, clean (B, L) long; L need not be a multiple of block_size (the last block is partial).
    """
    B, L = clean.shape
    keep = noisy_clean_mask(L, block_size, device=clean.device)[None, None]
    pos = noisy_clean_position_ids(L, device=clean.device)
    out = model(torch.cat([noisy, clean], dim=1), attention_mask=keep, position_ids=pos, return_logits=False)
    return out.last_hidden_state[:, :L]


def selected_logits(lm_head, hidden: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """fp32 logits (N, V) at the N positions where `select` (B, L) is True (row-major order)."""
    return lm_head(hidden[select]).float()


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    if logits.shape[0] == 0:
        return logits.sum() * 0.0  # keeps the graph (and DeepSpeed's hooks) alive with no token
    ce = F.cross_entropy(logits, targets, reduction="none")
    return (ce * weights).sum() if weights is not None else ce.sum()


def mixture_loss(model, lm_head, clean: torch.Tensor, response_mask: torch.Tensor, nb: NoisyBatch,
                 cfg: ObjectiveConfig, block_size: int, mask_id: int, shard: "LossShard | None" = None
                 ) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """M2T + T2T (+ MTF) loss of one batch.

    clean (B, L) long, response_mask (B, L) bool, nb the noise of this batch. Returns (loss scalar,
    metrics dict of floats, draft (B, L) long = noisy input with the first pass's argmax at the masks).
    shard: these rows are one rank's part of a larger batch (`LossShard`): every term is divided by the
    whole batch's count, so the ranks' losses and metrics add up to the whole batch's.
    """
    counts = shard.counts if shard is not None else None

    def denom(key: str, local: int) -> int:
        return max(int(counts[key]) if counts is not None else local, 1)

    hidden = noisy_half_hidden(model, nb.noisy, clean, block_size)
    metrics: dict[str, float] = {}
    # one LM-head call for every position that carries loss; split afterwards
    carry = nb.masked | nb.substituted | nb.kept
    logits = selected_logits(lm_head, hidden, carry)
    targets = clean[carry]
    kind_m = nb.masked[carry]
    kind_s = nb.substituted[carry]
    kind_k = nb.kept[carry]

    n_m = int(kind_m.sum())
    if cfg.normalize == "elbo":
        inv_t = (1.0 / nb.t)[:, None].expand_as(clean)[carry][kind_m]
        m2t = _ce_sum(logits[kind_m], targets[kind_m], inv_t) / denom("response", int(response_mask.sum()))
    else:
        m2t = _ce_sum(logits[kind_m], targets[kind_m]) / denom("masked", n_m)
    loss = m2t
    metrics["loss/m2t"] = float(m2t.detach())
    with torch.no_grad():
        pred = logits.detach().clone()
        pred[:, mask_id] = float("-inf")  # a draft never contains the mask token
        pred = pred.argmax(-1)
        if counts is not None:  # this rank's share of the whole batch's accuracy
            metrics["acc/m2t"] = float((pred[kind_m] == targets[kind_m]).float().sum()) / denom("masked", n_m)
        else:
            metrics["acc/m2t"] = float((pred[kind_m] == targets[kind_m]).float().mean()) if n_m else 0.0
    if cfg.t2t_weight > 0:
        n_s, n_k = int(kind_s.sum()), int(kind_k.sum())
        restore = _ce_sum(logits[kind_s], targets[kind_s]) / denom("substituted", n_s)
        keep = _ce_sum(logits[kind_k], targets[kind_k]) / denom("kept", n_k)
        loss = loss + cfg.t2t_weight * (restore + cfg.keep_weight * keep)
        metrics["loss/t2t_restore"] = float(restore.detach())
        metrics["loss/t2t_keep"] = float(keep.detach())
        if counts is not None:
            metrics["acc/t2t_restore"] = float((pred[kind_s] == targets[kind_s]).float().sum()) / denom(
                "substituted", n_s)
        elif n_s:
            metrics["acc/t2t_restore"] = float((pred[kind_s] == targets[kind_s]).float().mean())
    draft = nb.noisy.clone()
    draft[carry] = torch.where(kind_m, pred, draft[carry])
    if cfg.mtf_weight > 0 and cfg.mtf_fraction > 0:
        rows = shard.mtf_rows if shard is not None else slice(0, max(1, round(cfg.mtf_fraction * clean.shape[0])))
        drafted = nb.masked[rows]
        if drafted.shape[0]:
            mtf = mtf_loss(model, lm_head, draft[rows], clean[rows], drafted, block_size,
                           denominator=denom("mtf_drafted", int(drafted.sum())))
        else:  # a shard without MTF rows: its part of the whole batch's MTF term is 0
            mtf = loss.new_zeros(())
        loss = loss + cfg.mtf_weight * mtf
        metrics["loss/mtf"] = float(mtf.detach())
        metrics["acc/mtf_draft"] = metrics["acc/m2t"]
    metrics["loss/total"] = float(loss.detach())
    metrics["tokens/masked"] = float(n_m)
    return loss, metrics, draft


def mtf_loss(model, lm_head, draft: torch.Tensor, clean: torch.Tensor, drafted: torch.Tensor,
             block_size: int, denominator: int | None = None) -> torch.Tensor:
    """Multi-Turn Forward: per-token cross-entropy of `[draft ; clean]` at the drafted positions.

    draft (b, L): the first pass's noisy input with its own predictions written at the masks (detached:
    no gradient flows into the first pass through the draft); drafted (b, L) bool marks those positions.
    Correct draft tokens teach "keep", wrong ones "fix": the errors are the model's own.
    """
    hidden = noisy_half_hidden(model, draft, clean, block_size)
    logits = selected_logits(lm_head, hidden, drafted)
    return _ce_sum(logits, clean[drafted]) / (denominator or max(int(drafted.sum()), 1))
