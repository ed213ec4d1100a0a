"""Editing-aware noise draws of the EBPO composite: M2T masks plus T2T substitutions in every draw.

The mask-only composite (`ebpo.core.likelihood`) scores a response token only where it is masked, so the
policy is never asked about a wrong visible token, and RL cannot teach the editor (the T2T rule of the
decoder). Here each draw n also picks, among the response tokens its masks left visible, a fraction
`rate` and replaces them by a wrong token; the composite then scores the clean token at both kinds of
position:

    C_n = sum_b [ sum_{i masked in b} w^M_{n,i} log p(y_i | z_n, y_<b)
                  + (lambda / rate) sum_{i substituted in b} log p(y_i | z_n, y_<b) ]

with w^M the M2T weight of the chosen noise form (1/t or m/k), lambda = `learner.t2t_weight` and z_n the
noisy block holding masks and substitutes. Why lambda / rate: each visible token is substituted with
probability `rate`, so the T2T term estimates lambda * sum_{i visible} E[log p(y_i | i substituted)], the
log-likelihood of restoring every visible token, whatever the rate (the rate only sets the variance and
how much wrong context the M2T positions see). Substitutes come from (`source`):

* `uniform`: a token drawn uniformly from `allowed_ids` minus the clean one (`ebpo.core.noise.t2t_substitute`,
  the CPT/SFT T2T stream);
* `draft`: the model's own draft, as in Multi-Turn Forward: the chosen positions are masked too, one
  no-grad forward of the policy (the behaviour policy at the start of the update) samples a token at each
  of them (temperature 1, never the mask token); a position whose draft equals the clean token is not a
  substitution (it is left visible and carries no T2T term, like the clean token it is);
* `mixed`: each chosen position takes the draft or a uniform token with probability 1/2.

The draws (masks, substitutions and substitute ids) are fixed before any likelihood is computed, so the
current, old and reference policies score the same noisy inputs and the noise cancels in their
differences. Randomness comes only from the generator passed in; the learner gives this module a
generator of its own, so the M2T draws and the minibatch order are those of the mask-only learner.
`t2t_weight = 0` adds nothing (the learner does not call this module) and the composite is the
mask-only one bit for bit.
"""
from __future__ import annotations

import torch

from ebpo.core.likelihood import NoiseDraws, unwrap_hidden
from ebpo.core.noise import substitution_ids, t2t_substitute
from ebpo.model.masks import packed_noisy_clean_mask, noisy_clean_position_ids

T2T_SOURCES = ("uniform", "draft", "mixed")


def check_t2t(weight: float, rate: float, source: str, prefix: str = "learner.") -> None:
    """Raise ValueError naming the key when the editing-aware settings are out of range."""
    if not weight >= 0:
        raise ValueError(f"{prefix}t2t_weight: must be >= 0 (0 = mask-only composite), got {weight!r}")
    if not 0.0 < rate < 1.0:
        raise ValueError(f"{prefix}t2t_rate: must lie in (0, 1), got {rate!r}")
    if source not in T2T_SOURCES:
        raise ValueError(f"{prefix}t2t_source: choose one of {list(T2T_SOURCES)}, got {source!r}")


def t2t_seed(seed: int, update: int) -> int:
    """Seed of the T2T generator of update number `update`: a function of (seed, update) only, so a
    resumed learner draws the same substitutions without storing another generator state."""
    return (int(seed) * 1_000_003 + int(update) * 7919 + 0x5EED) % (2 ** 63)


def choose_positions(noise: NoiseDraws, response_mask: torch.Tensor, rate: float,
                     generator: torch.Generator) -> torch.Tensor:
    """(N, B, L) bool: each response position left visible by draw n's masks, with probability `rate`."""
    N, B, L = noise.masked.shape
    coins = torch.rand(N, B, L, generator=generator, device=generator.device)
    resp = response_mask.to(noise.masked.device).bool()
    return (coins.to(noise.masked.device) < rate) & resp[None] & ~noise.masked


def uniform_substitutes(input_ids: torch.Tensor, chosen: torch.Tensor, allowed_ids: torch.Tensor,
                        generator: torch.Generator) -> torch.Tensor:
    """(N, B, L) long: at `chosen` positions a token uniform over `allowed_ids` minus the clean one."""
    N, B, L = chosen.shape
    tokens = input_ids.to(chosen.device)[None].expand(N, B, L).reshape(N * B, L)
    new, _ = t2t_substitute(tokens, chosen.reshape(N * B, L), 1.0, allowed_ids, generator)
    return new.view(N, B, L)


@torch.no_grad()
def draft_substitutes(model, input_ids: torch.Tensor, noise: NoiseDraws, chosen: torch.Tensor, mask_token_id: int,
                      generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
    """(N, B, L) long: the model's sampled draft at `chosen` positions (clean tokens elsewhere).

    Draw n's input is its M2T masks plus the chosen positions masked, in the `[noisy ; clean]` layout of
    the likelihood (noisy block b sees itself and clean blocks < b); one forward per draw. Tokens are
    sampled on the generator's device from softmax(logits / temperature) with the mask token excluded.
    """
    N, B, L = chosen.shape
    K = noise.block_size
    dev = input_ids.device
    keep = packed_noisy_clean_mask(L, K, 1, device=dev)[None, None]
    pos = noisy_clean_position_ids(L, 1, device=dev)
    head = model.get_output_embeddings()
    out = input_ids.to(chosen.device)[None].expand(N, B, L).clone()
    for n in range(N):
        hole = (noise.masked[n] | chosen[n]).to(dev)
        noisy = input_ids.masked_fill(hole, mask_token_id)
        h = unwrap_hidden(model(input_ids=torch.cat([noisy, input_ids], 1), attention_mask=keep, position_ids=pos,
                                 return_logits=False))[:, :L]
        sel = chosen[n].to(dev).nonzero(as_tuple=True)
        if sel[0].numel() == 0:
            continue
        with torch.autocast(dev.type, enabled=False):
            w = head.weight.float()
            logits = torch.nn.functional.linear(h[sel].float(), w, None if head.bias is None else head.bias.float())
        logits[:, mask_token_id] = float("-inf")  # a draft never holds the mask token
        probs = (logits / temperature).softmax(-1).to(generator.device)
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        out[n][chosen[n].nonzero(as_tuple=True)] = tok.to(out.device)
    return out


def add_substitutions(noise: NoiseDraws, input_ids: torch.Tensor, response_mask: torch.Tensor, *, rate: float,
                      weight: float, source: str, allowed_ids: torch.Tensor, generator: torch.Generator,
                      model=None, mask_token_id: int | None = None) -> NoiseDraws:
    """`noise` with T2T substitutions added to every draw (module docstring); masks and M2T weights unchanged.

    input_ids (B, L) long clean sequences, response_mask (B, L) bool; `model` and `mask_token_id` are
    needed by the `draft` and `mixed` sources. Substituted positions get weight `weight / rate`.
    """
    check_t2t(weight, rate, source, prefix="")
    chosen = choose_positions(noise, response_mask, rate, generator)
    if source == "uniform":
        sub_ids = uniform_substitutes(input_ids, chosen, allowed_ids, generator)
    else:
        if model is None or mask_token_id is None:
            raise ValueError(f"t2t_source={source!r} needs the model and the mask token id")
        sub_ids = draft_substitutes(model, input_ids, noise, chosen, mask_token_id, generator)
        if source == "mixed":
            coin = torch.rand(chosen.shape, generator=generator, device=generator.device).to(chosen.device) < 0.5
            sub_ids = torch.where(coin, uniform_substitutes(input_ids, chosen, allowed_ids, generator), sub_ids)
    clean = input_ids.to(chosen.device)[None]
    substituted = chosen & (sub_ids != clean)  # a draft that equals the clean token is no substitution
    w = noise.weight + torch.where(substituted, weight / rate, 0.0)  # Python scalars: no tensor on a default device
    return NoiseDraws(masked=noise.masked, t=noise.t, weight=w, block_size=noise.block_size,
                      substituted=substituted, sub_ids=torch.where(substituted, sub_ids, clean))


def t2t_stats(noise: NoiseDraws) -> dict:
    """Mean substituted positions per (draw, sequence): `likelihood/substituted_per_seq` (0 for mask-only draws)."""
    if noise.substituted is None:
        return {"likelihood/substituted_per_seq": 0.0}
    return {"likelihood/substituted_per_seq": float(noise.substituted.float().sum(-1).mean())}


def editing_draws(noise: NoiseDraws, input_ids: torch.Tensor, response_mask: torch.Tensor, *, rate: float,
                  weight: float, source: str, seed: int, update: int, model, model_config) -> NoiseDraws:
    """A learner's editing-aware draws: `add_substitutions` with these rate, weight and source, substitutes
    drawn from every id but the mask and BOS tokens of `model_config`, and a generator seeded by
    `t2t_seed(seed, update)` (its own, so the learner's main generator, hence the M2T draws and minibatch
    order, is untouched). `update`: the learner's update count (0-based)."""
    allowed = substitution_ids(model_config.vocab_size, [model_config.mask_token_id, model_config.bos_token_id])
    return add_substitutions(noise, input_ids, response_mask, rate=rate, weight=weight, source=source,
                             allowed_ids=allowed, model=model,
                             generator=torch.Generator().manual_seed(t2t_seed(seed, update)),
                             mask_token_id=model_config.mask_token_id)
