"""L-EBPO (LLaDA2.2): the block-ELBO composite over the extended action space, vocabulary + {DELETE, INSERT}.

DELETE and INSERT never appear in a response, so the composite cannot score them from the output alone. The
rollout keeps, for every block in which the decoder applied a Levenshtein operation, the block as it stood
right before the first one (`GenerationOutput.lev_drafts`; `drafts_from_rollouts` lays them over the output).
Each noise draw n then

1. noises that draft with draw n's masks (the same positions and levels t as EBPO's mask-only draw), giving
   z_n; blocks without a Levenshtein operation have the output as their draft, so z_n is EBPO's noisy input;
2. recovers the edit labels of z_n per block by aligning it with the output, with the LCS rules of SFT
   (`ebpo.core.levenshtein.lcs_labels`: a [MASK] matches any token): fill / substitute (a token), DELETE,
   INSERT, or keep;
3. scores every response position whose label is not keep:

    C_n = sum_b [ sum_{i masked in b} (1 / t_{n,b}) log p(a_{n,i} | z_n, y_<b)
                  + lambda sum_{i visible, a_{n,i} != keep} log p(a_{n,i} | z_n, y_<b) ]

with a_{n,i} the label id (the target token, DELETE or INSERT) and lambda = `learner.levenshtein_weight`.

When no rollout contains an insert or delete, every draft is its output, the alignment of a masked output with
the output is the identity (the only alignment with K anchors), every masked position is labelled with its own
clean token and no visible position is scored: z_n, the scored positions, their targets and weights are EBPO's,
and the composites are computed by the same operations, bit for bit.
"""
from __future__ import annotations

import torch

from ebpo.core.levenshtein import KEEP, label_ids, lcs_labels
from ebpo.core.likelihood import NoiseDraws


def drafts_from_rollouts(input_ids: torch.Tensor, prompt_lens: torch.Tensor, lev_drafts: list, block_size: int,
                         response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L) long: `input_ids` with each recorded pre-edit block laid over its block.

    lev_drafts[i]: the rollout's `lev_drafts`, a list of (block start offset from the prompt's end, K tokens),
    the start possibly negative (the prompt's tail shares the block); blocks past L are ignored. A multi-turn
    row's offsets count from the end of its first prompt (`Trajectory.prompt_ids`, the learner's prompt_lens),
    so a later turn's block lies after observations; its first block may start inside the observation before it.

    response_mask (B, L) bool (optional, the scored positions): the context that opens a block (prompt tail,
    observation tail) is never written or moved by the decoder, so a draft must hold it unchanged; one that does
    not raises ValueError (a draft recorded at the wrong offset would otherwise turn context into edit labels).
    """
    out = input_ids.clone()
    B, L = out.shape
    for i, recs in enumerate(lev_drafts or []):
        for start, toks in recs or []:
            lo = int(prompt_lens[i]) + int(start)
            if lo < 0 or lo + block_size > L:
                continue
            draft = torch.as_tensor(toks, dtype=out.dtype, device=out.device)
            if response_mask is not None and bool(response_mask[i, lo:lo + block_size].any()):
                ctx = int(response_mask[i, lo:lo + block_size].to(torch.uint8).argmax())  # context prefix length
                if not torch.equal(draft[:ctx], out[i, lo:lo + ctx]):
                    raise ValueError(f"lev_drafts: row {i}, block at offset {int(start)}: the draft changes the "
                                     f"{ctx} context token(s) that open the block")
            out[i, lo:lo + block_size] = draft
    return out


def levenshtein_draws(noise: NoiseDraws, input_ids: torch.Tensor, response_mask: torch.Tensor,
                      drafts: torch.Tensor | None, mask_token_id: int, delete_id: int, insert_id: int,
                      weight: float = 1.0) -> NoiseDraws:
    """`noise` (mask-only, N draws of B sequences of length L, a multiple of K) turned into L-EBPO draws.

    input_ids (B, L) the outputs; response_mask (B, L) bool; drafts (B, L) from `drafts_from_rollouts` (None =
    the outputs). Returns draws with `noisy_ids` = z_n, `targets` = label ids, `masked` = masked response
    positions, `substituted` = visible response positions with a non-keep label (weight `weight`).
    """
    if noise.substituted is not None or noise.noisy_ids is not None:
        raise ValueError("learner.levenshtein: combine it with mask-only draws (learner.t2t_weight = 0)")
    N, B, L = noise.masked.shape
    K = noise.block_size
    if L % K:
        raise ValueError(f"levenshtein_draws: length {L} is not a multiple of the block size {K}")
    dev = noise.masked.device
    clean = input_ids.to(dev)
    draft = clean if drafts is None else drafts.to(dev)
    resp = response_mask.to(dev).bool()
    z = torch.where(noise.masked, torch.full((), mask_token_id, device=dev, dtype=clean.dtype), draft[None])
    ops, toks = lcs_labels(z.reshape(-1, K), clean[None].expand(N, B, L).reshape(-1, K), mask_token_id)
    ops, toks = ops.view(N, B, L), toks.view(N, B, L)
    targets = label_ids(ops, toks, delete_id, insert_id)
    edited = resp[None] & ~noise.masked & (ops != KEEP)
    w = torch.where(edited, torch.full((), float(weight), device=dev), noise.weight)
    return NoiseDraws(masked=noise.masked, t=noise.t, weight=w, block_size=K, substituted=edited,
                      sub_ids=z, noisy_ids=z, targets=targets)


def lev_stats(noise: NoiseDraws, model_config) -> dict:
    """Mean DELETE / INSERT / visible edit labels per (draw, sequence) of L-EBPO draws (`likelihood/lev_*`; {} for
    other draws)."""
    if noise.targets is None:
        return {}
    delete_id, insert_id = model_config.delete_token_id, model_config.insert_token_id
    s = noise.scored()
    per = float(s.shape[0] * s.shape[1])
    return {"likelihood/lev_deletes_per_seq": float((s & (noise.targets == delete_id)).sum()) / per,
            "likelihood/lev_inserts_per_seq": float((s & (noise.targets == insert_id)).sum()) / per,
            "likelihood/lev_visible_scored_per_seq": float(noise.substituted.sum()) / per}


def learner_draws(noise: NoiseDraws, input_ids: torch.Tensor, response_mask: torch.Tensor, prompt_lens,
                  lev_drafts: list | None, model_config, weight: float) -> NoiseDraws:
    """The learner's L-EBPO draws (`learner.levenshtein: true`): `levenshtein_draws` with the drafts of
    `lev_drafts` (per sequence, the rollout's `lev_drafts`; None = no Levenshtein operation; `prompt_lens` (B,)
    places them) and the
    model's edit-control ids. A length that is not a whole number of blocks is padded with [MASK] (a wildcard
    that no real position can be scored against) for the alignment and cut back."""
    if getattr(model_config, "delete_token_id", None) is None:
        raise ValueError("learner.levenshtein: the model's config has no delete_token_id / insert_token_id")
    K, mask = noise.block_size, int(model_config.mask_token_id)
    B, L = input_ids.shape
    drafts = None
    if lev_drafts is not None:
        drafts = drafts_from_rollouts(input_ids.cpu(), torch.as_tensor(prompt_lens, device="cpu"), lev_drafts, K,
                                      response_mask.cpu().bool())
    pad = -L % K
    if pad:
        def widen(x, fill):
            return torch.cat([x, torch.full((*x.shape[:-1], pad), fill, dtype=x.dtype, device=x.device)], -1)

        wide = NoiseDraws(widen(noise.masked, False), noise.t, widen(noise.weight, 0.0), K)
        out = levenshtein_draws(wide, widen(input_ids, mask), widen(response_mask.bool(), False),
                                None if drafts is None else widen(drafts, mask), mask, model_config.delete_token_id,
                                model_config.insert_token_id, weight)
        return NoiseDraws(masked=noise.masked, t=noise.t, weight=out.weight[..., :L], block_size=K,
                          substituted=out.substituted[..., :L], sub_ids=out.sub_ids[..., :L],
                          noisy_ids=out.noisy_ids[..., :L], targets=out.targets[..., :L])
    return levenshtein_draws(noise, input_ids, response_mask, drafts, mask, model_config.delete_token_id,
                             model_config.insert_token_id, weight)
