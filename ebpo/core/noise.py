"""Training noise for block diffusion: stratified noise levels, M2T masking and T2T token substitution.

All functions are pure torch: randomness comes only from the `torch.Generator` passed in.

Shapes: `B` examples of length `L`. `response_mask` (B, L) bool marks the positions that may be noised
(the response in SFT, the whole document in CPT; never the prompt, never padding beyond the last block).

* M2T (mask-to-token): example i gets a noise level t_i; each response token is replaced by the mask id
  with probability t_i. At least one response token of every non-empty example is masked, so that every
  example contributes to the M2T loss (the ELBO is an expectation over t in (0, 1], and a draw with no mask
  carries no signal).
* T2T (token-to-token): a fraction `rate` of the response tokens that stayed visible is replaced by a
  token drawn uniformly from `allowed_ids` and always different from the original, so the model sees
  plausible-looking wrong tokens and must restore them (docs/background.md section 4: rates are ours to choose).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def stratified_levels(batch_size: int, t_min: float, t_max: float, generator: torch.Generator) -> torch.Tensor:
    """(B,) noise levels in [t_min, t_max]: one per stratum of width (t_max - t_min) / B, strata shuffled.

    Stratification lowers the variance of a batch's loss compared with i.i.d. uniform levels, while each
    t_i is still marginally uniform on [t_min, t_max].
    """
    if not 0.0 <= t_min <= t_max <= 1.0:
        raise ValueError(f"noise levels need 0 <= t_min <= t_max <= 1, got t_min={t_min}, t_max={t_max}")
    u = torch.rand(batch_size, generator=generator)
    strata = torch.randperm(batch_size, generator=generator).float()
    return t_min + (t_max - t_min) * (strata + u) / batch_size


def m2t_mask(response_mask: torch.Tensor, t: torch.Tensor, generator: torch.Generator,
             min_one: bool = True) -> torch.Tensor:
    """(B, L) bool: which response positions get the mask token; position masked with probability t[i].

    response_mask (B, L) bool, t (B,) in [0, 1]. With `min_one`, an example whose draw masked nothing
    gets one uniformly chosen response position masked.
    """
    u = torch.rand(response_mask.shape, generator=generator)
    masked = (u < t[:, None]) & response_mask
    if min_one:
        empty = ~masked.any(dim=1) & response_mask.any(dim=1)
        if empty.any():
            # a random key per position, -1 outside the response: argmax picks a uniform response position
            keys = torch.rand(response_mask.shape, generator=generator).masked_fill(~response_mask, -1.0)
            pick = keys.argmax(dim=1)
            rows = empty.nonzero().flatten()
            masked[rows, pick[rows]] = True
    return masked


def t2t_substitute(tokens: torch.Tensor, candidates: torch.Tensor, rate: float, allowed_ids: torch.Tensor,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace a fraction `rate` of the `candidates` positions by random tokens different from the original.

    tokens (B, L) long, candidates (B, L) bool (the visible response positions), allowed_ids (A,) long
    sorted unique ids to draw from (A >= 2). Returns (new_tokens (B, L), substituted (B, L) bool).
    The replacement is uniform over `allowed_ids` minus the original token (uniform over all of
    `allowed_ids` when the original is not among them).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"t2t rate must lie in [0, 1], got {rate}")
    allowed_ids = allowed_ids.to(tokens.device)
    A = allowed_ids.numel()
    if A < 2:
        raise ValueError("t2t substitution needs at least two allowed token ids")
    sub = (torch.rand(tokens.shape, generator=generator, device=generator.device) < rate) & candidates
    # index of the original among the allowed ids (A when absent)
    pos = torch.searchsorted(allowed_ids, tokens).clamp(max=A - 1)
    present = allowed_ids[pos] == tokens
    pos = torch.where(present, pos, torch.full_like(pos, A))
    # draw from A-1 slots skipping the original's slot when present, from all A slots otherwise
    r = torch.rand(tokens.shape, generator=generator, device=generator.device)
    n_choices = torch.where(present, torch.full_like(pos, A - 1), torch.full_like(pos, A))
    j = (r * n_choices).long().clamp(max=A - 1)
    j = j + (present & (j >= pos)).long()
    new = torch.where(sub, allowed_ids[j.clamp(max=A - 1)], tokens)
    return new, sub


def substitution_ids(vocab_size: int, exclude: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Sorted ids in [0, vocab_size) minus `exclude` (e.g. mask, BOS and role tokens) as a long tensor."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    for i in exclude:
        if 0 <= i < vocab_size:
            keep[i] = False
    return keep.nonzero().flatten()


@dataclass
class NoisyBatch:
    """The noised inputs of one batch and where each kind of noise went (all (B, L) except t)."""

    noisy: torch.Tensor          # long: clean tokens with masks and substitutions applied
    masked: torch.Tensor         # bool: M2T positions (mask token in `noisy`)
    substituted: torch.Tensor    # bool: T2T positions (a wrong random token in `noisy`)
    kept: torch.Tensor           # bool: visible response positions left unchanged
    t: torch.Tensor              # (B,) float: noise level of each example


def make_noisy(clean: torch.Tensor, response_mask: torch.Tensor, *, mask_id: int, t_min: float, t_max: float,
               t2t_rate: float, allowed_ids: torch.Tensor | None, generator: torch.Generator,
               min_one: bool = True) -> NoisyBatch:
    """Apply M2T masking (stratified t) then T2T substitution of visible response tokens to `clean` (B, L)."""
    B = clean.shape[0]
    t = stratified_levels(B, t_min, t_max, generator)
    masked = m2t_mask(response_mask, t, generator, min_one=min_one)
    noisy = clean.masked_fill(masked, mask_id)
    visible = response_mask & ~masked
    if t2t_rate > 0:
        if allowed_ids is None:
            raise ValueError("t2t_rate > 0 needs allowed_ids")
        noisy, substituted = t2t_substitute(noisy, visible, t2t_rate, allowed_ids, generator)
    else:
        substituted = torch.zeros_like(masked)
    return NoisyBatch(noisy=noisy, masked=masked, substituted=substituted, kept=visible & ~substituted, t=t)
