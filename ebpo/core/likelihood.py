"""Vectorized block-ELBO composite likelihood of a response (the EBPO log-ratio) and gradient replay.

Layout (docs/background.md sections 2, 5, 8). A sequence `x` of length L = prompt + response (+ right padding)
is cut into blocks of K tokens by absolute position (`block = position // K`; the prompt's last partial
block is part of that block). A *noisy copy* replaces some response tokens by the mask token; prompt,
padding and unmasked response tokens stay as they are. One forward over `[noisy ; clean]` with the
training mask of `ebpo.model.masks` scores every block at once: noisy block b sees itself and clean blocks < b.
The packed form `[noisy_1 .. noisy_S ; clean]` shares one clean copy among S draws ((S+1)L tokens
instead of 2SL) and gives the same log-probabilities.

Composite of draw n for one sequence (t_{n,b} the noise level of block b in draw n):

    C_n = sum_{blocks b with response tokens} (1 / t_{n,b}) * sum_{masked i in b} log p_theta(x_i | noisy_n, clean < b)

Noise levels (design choices, documented in docs/ebpo.md):
  * stratified per (sequence, block): t_n = t_min + (t_max - t_min) * (n + u) / N with one offset
    u ~ U[0, 1) drawn independently for every (sequence, block), so each block's N levels cover
    [t_min, t_max] evenly and t_n is marginally uniform on [t_min, t_max] when n is uniform;
  * each response token of the block is masked with probability t_n (independently);
  * if that masks nothing in a block that has response tokens, one of its response tokens, chosen
    uniformly, is masked instead ("forcing"). Forcing changes the masking distribution only on the
    event "nothing masked" (probability (1 - t)^m for m response tokens in the block), so the estimator
    is exactly unbiased for the *forced* objective E_{t ~ U[t_min, t_max]} E_{mask ~ forced Bernoulli(t)} [C]
    (which the tests compute by enumeration), not for the plain 1/t ELBO: it adds the term
    E_t[(1 - t)^m / t * mean_i log p(x_i | only i masked)] that the plain ELBO gives weight 0.
  * only response tokens up to and including the first EOS carry loss (`response_mask`); padding never.

The same `NoiseDraws` (drawn once from an explicit `torch.Generator`) are reused for the current, old
and reference policies, so the Monte Carlo noise cancels in their differences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ebpo.model.masks import CopyBlockLayout, block_causal_mask, noisy_clean_position_ids, packed_noisy_clean_mask
from ebpo.model.cache import BlockKVCache


# ----------------------------------------------------------------------------------------------------
# Response mask and noise draws
# ----------------------------------------------------------------------------------------------------

def response_mask_from_ids(input_ids: torch.Tensor, prompt_lens: torch.Tensor, eos_id: int,
                           seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L) bool: response positions from `prompt_lens[i]` up to and including the first EOS.

    input_ids (B, L) long, right-padded; prompt_lens (B,) long. A response without EOS runs to
    `seq_lens[i]` (total prompt + response length, (B,)) when given, else to L. An EOS inside the
    prompt does not count: only EOS at positions >= prompt_lens[i] end the response.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected (B, L), got {tuple(input_ids.shape)}")
    B, L = input_ids.shape
    pos = torch.arange(L, device=input_ids.device)[None, :]
    prompt_lens = prompt_lens.to(input_ids.device).long()
    if prompt_lens.shape != (B,):
        raise ValueError(f"prompt_lens: expected shape ({B},), got {tuple(prompt_lens.shape)}")
    in_resp = pos >= prompt_lens[:, None]
    if seq_lens is not None:
        in_resp = in_resp & (pos < seq_lens.to(input_ids.device).long()[:, None])
    is_eos = (input_ids == eos_id) & in_resp
    # EOS positions strictly before i (exclusive cumulative count) end the response before i.
    eos_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return in_resp & ~eos_before


@dataclass
class NoiseDraws:
    """N noise draws for a batch, shared by current, old and reference policies.

    masked: (N, B, L) bool, response positions replaced by the mask token in draw n.
    t: (N, B, nb) fp32 noise level of every (draw, sequence, block); nb = ceil(L / K).
    weight: (N, B, L) fp32, 1 / t of the position's block where masked, the T2T weight where substituted,
        else 0.
    block_size: K.
    substituted: None (mask-only draws) or (N, B, L) bool, visible response positions whose token is
        replaced by `sub_ids` in draw n (T2T noise, `ebpo.core.editing`); disjoint from `masked`.
    sub_ids: None or (N, B, L) long, the substitute token at substituted positions (ignored elsewhere).
    noisy_ids: None or (N, B, L) long, the whole noisy input of draw n (L-EBPO, `ebpo.core.lev_likelihood`:
        a shifted draft is not a position-wise corruption of the output); overrides masked / sub_ids there.
    targets: None or (N, B, L) long, the action scored at each scored position (L-EBPO: a token, DELETE or
        INSERT); None = the clean token.
    """

    masked: torch.Tensor
    t: torch.Tensor
    weight: torch.Tensor
    block_size: int
    substituted: torch.Tensor | None = None
    sub_ids: torch.Tensor | None = None
    noisy_ids: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    @property
    def n_draws(self) -> int:
        return self.masked.shape[0]

    def scored(self) -> torch.Tensor:
        """(N, B, L) bool: positions that carry a log-prob term (masked, and substituted when present)."""
        return self.masked if self.substituted is None else self.masked | self.substituted

    def _cut(self, idx, length=None) -> "NoiseDraws":
        def cut(x):
            return None if x is None else (x[:, idx] if length is None else x[:, idx][..., :length])

        t = self.t[:, idx] if length is None else self.t[:, idx][..., : length // self.block_size]
        return NoiseDraws(cut(self.masked), t, cut(self.weight), self.block_size, cut(self.substituted),
                          cut(self.sub_ids), cut(self.noisy_ids), cut(self.targets))

    def rows(self, idx: torch.Tensor) -> "NoiseDraws":
        """The draws of the sequences `idx` (a minibatch), same draws."""
        return self._cut(idx)

    def take(self, idx: torch.Tensor, length: int | None = None) -> "NoiseDraws":
        """The draws of the sequences `idx`, cut to the first `length` positions (a whole number of blocks;
        None = all): what a micro-batch trimmed of trailing padding blocks needs."""
        if length is None or length >= self.masked.shape[-1]:
            return self.rows(idx)
        if length % self.block_size:
            raise ValueError(f"NoiseDraws.take: length {length} is not a multiple of the block size {self.block_size}")
        return self._cut(idx, length)


def turn_response_mask(generated: torch.Tensor, segment: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, L) bool response mask of multi-turn sequences: the model-generated tokens, every turn at once.

    generated (B, L) bool (True where the model wrote the token; environment and prompt tokens are
    context); segment (B, L) long, the time-ordered segment of each token (`ebpo.core.turns`; right
    padding -1). The sequences must be laid out by `ebpo.core.turns.layout_segments` (every model turn
    padded to a block boundary): then the ordinary composite of `draw_noise` / `composite_logprobs` on
    this mask scores each turn with only its past visible (docs/ebpo.md, "Multi-turn"). A block that
    holds model tokens together with a later segment would let them see the future: refused
    (ValueError naming the row and block).
    """
    from ebpo.core.turns import leaking_blocks

    bad = leaking_blocks(generated, segment, block_size)
    if bad.any():
        row, blk = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"turn_response_mask: row {row} block {blk} holds model tokens and a later segment "
                         "(environment tokens after a turn must start a new block: ebpo.core.turns.layout_segments)")
    return generated.bool()


def per_turn_composites(blocks: torch.Tensor, turn: torch.Tensor, block_size: int, n_turns: int) -> torch.Tensor:
    """Split per-block composites into per-turn ones: blocks (B, N, nb) (`return_blocks=True`), turn (B, L)
    long (`ebpo.core.turns.turn_index`: the model turn of each generated token, -1 for context) ->
    (B, N, n_turns), whose sum over turns is the composite. With aligned turns a block's terms belong to one
    turn (the one whose tokens it holds); blocks without generated tokens contribute nothing."""
    B, N, nb = blocks.shape
    L = turn.shape[1]
    pad = nb * block_size - L
    per_block = torch.nn.functional.pad(turn.long(), (0, max(pad, 0)), value=-1)[:, : nb * block_size]
    per_block = per_block.view(B, nb, block_size).amax(-1)  # (B, nb), -1: no generated token
    onehot = torch.nn.functional.one_hot(per_block.clamp(min=0), n_turns).to(blocks.dtype)
    onehot = onehot * (per_block >= 0)[..., None].to(blocks.dtype)  # (B, nb, T)
    return torch.einsum("bnk,bkt->bnt", blocks, onehot)


NOISE_FORMS = ("bernoulli", "exact_elbo")


def draw_noise(response_mask: torch.Tensor, block_size: int, n_draws: int, t_min: float, t_max: float,
               generator: torch.Generator, form: str = "bernoulli") -> NoiseDraws:
    """Stratified noise levels and masks (see module docstring) from `generator` only.

    response_mask (B, L) bool; 0 < t_min <= t_max <= 1; n_draws >= 1. Returns `NoiseDraws` on the
    generator's device. Every block that holds a response token has at least one masked token.
    form="bernoulli": the forced Bernoulli(t) masks with 1/t weights described above; form="exact_elbo":
    exactly k ~ U{1..m} of a block's m response tokens masked, weight m/k (`ebpo.core.noise_draws`;
    t_min/t_max unused).
    """
    if form == "exact_elbo":
        from ebpo.core.noise_draws import exact_elbo_masks

        masked, t, weight = exact_elbo_masks(response_mask, block_size, n_draws, generator)
        return NoiseDraws(masked=masked, t=t, weight=weight, block_size=block_size)
    if form != "bernoulli":
        raise ValueError(f"noise form: expected one of {NOISE_FORMS}, got {form!r}")
    if not 0.0 < t_min <= t_max <= 1.0:
        raise ValueError(f"t_min/t_max: need 0 < t_min <= t_max <= 1, got t_min={t_min}, t_max={t_max}")
    if n_draws < 1:
        raise ValueError(f"n_draws: must be >= 1, got {n_draws}")
    dev = generator.device
    resp = response_mask.to(dev).bool()
    B, L = resp.shape
    K = block_size
    nb = (L + K - 1) // K
    blk = torch.arange(L, device=dev) // K  # (L,)
    u = torch.rand(B, nb, generator=generator, device=dev)  # one offset per (sequence, block)
    n = torch.arange(n_draws, device=dev, dtype=torch.float32)[:, None, None]
    t = t_min + (t_max - t_min) * (n + u[None]) / n_draws  # (N, B, nb)
    t_tok = t[:, :, blk]  # (N, B, L)
    coins = torch.rand(n_draws, B, L, generator=generator, device=dev)
    masked = (coins < t_tok) & resp[None]
    # Forcing: blocks with response tokens but nothing masked get one uniformly chosen response token.
    scores = torch.rand(n_draws, B, L, generator=generator, device=dev).masked_fill(~resp[None], -1.0)
    per_block = torch.full((n_draws, B, nb * K), -1.0, device=dev)
    per_block[..., :L] = scores
    per_block = per_block.view(n_draws, B, nb, K)
    best = per_block.argmax(-1)  # (N, B, nb): uniform among response tokens of the block
    n_masked = torch.zeros(n_draws, B, nb, device=dev).index_add_(2, blk, masked.float())
    has_resp = torch.zeros(B, nb, device=dev).index_add_(1, blk, resp.float()) > 0
    need = (n_masked == 0) & has_resp[None]
    force_pos = best + torch.arange(nb, device=dev) * K  # absolute position of the forced token
    forced = torch.zeros(n_draws, B, nb * K, dtype=torch.bool, device=dev)
    forced.scatter_(2, force_pos, need)
    masked = masked | forced[..., :L]
    weight = torch.where(masked, 1.0 / t_tok, torch.zeros((), device=dev))
    return NoiseDraws(masked=masked, t=t, weight=weight, block_size=K)


# ----------------------------------------------------------------------------------------------------
# Token log-probs of gathered rows
# ----------------------------------------------------------------------------------------------------

def _kernel_token_logprobs():
    try:
        from kernels.logprobs import token_logprobs  # optional fused, memory-light kernel
        return token_logprobs
    except Exception:  # not written yet or unavailable: the plain-torch path below is exact
        return None


# rows of the LM head computed at once through the head module (ZeRO-3) when gradients are needed
MODULE_HEAD_CHUNK = 2048


def gathered_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, use_module_head: bool = False) -> torch.Tensor:
    """log p(targets) for gathered hidden rows: hidden (M, H), targets (M,) -> (M,) fp32.

    Uses `kernels.logprobs.token_logprobs` when importable; `use_module_head=True` calls the LM head
    module instead of reading its weight (needed when the weight is partitioned, e.g. DeepSpeed ZeRO-3).
    """
    head = model.get_output_embeddings()
    # The head, log-softmax and everything after run in fp32 even when the body ran in bf16 (autocast or
    # bf16 weights): a bf16 log-prob error summed over thousands of tokens exceeds the clip window.
    with torch.autocast(hidden.device.type, enabled=False):
        if use_module_head:  # partitioned weight (ZeRO-3): the module computes in its own dtype
            def rows_logprobs(h, tg):
                logits = head(h.to(head.weight.dtype)).float()
                return logits.log_softmax(-1).gather(-1, tg[:, None]).squeeze(-1)

            M = hidden.shape[0]
            if not torch.is_grad_enabled() or M <= MODULE_HEAD_CHUNK:
                return rows_logprobs(hidden, targets)
            # With grad, autograd would keep fp32 logits and log-softmax of every row: 1.3 MB per scored
            # token at a 157k vocabulary. Chunks under checkpointing keep only their input rows; each
            # chunk's logits are recomputed (the module re-gathers its weight) in the backward.
            from torch.utils.checkpoint import checkpoint

            return torch.cat([checkpoint(rows_logprobs, hidden[s:s + MODULE_HEAD_CHUNK],
                                         targets[s:s + MODULE_HEAD_CHUNK], use_reentrant=False)
                              for s in range(0, M, MODULE_HEAD_CHUNK)])
        weight = head.weight if head.weight.dtype == torch.float32 else head.weight.float()
        kernel = _kernel_token_logprobs()
        if kernel is not None and getattr(head, "bias", None) is None:
            return kernel(hidden.float(), weight, targets).float()
        bias = None if getattr(head, "bias", None) is None else head.bias.float()
        logits = torch.nn.functional.linear(hidden.float(), weight, bias)
        return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------------------------------
# Composites
# ----------------------------------------------------------------------------------------------------

def unwrap_hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _noisy_inputs(noise: NoiseDraws, draws: Sequence[int], input_ids: torch.Tensor, mask_token_id: int):
    """(noisy ids, scored positions, weights, targets), each (S, B, L), of the draws `draws` on input_ids' device.

    noisy = mask token at masked positions, the substitute at substituted ones (T2T draws), else the clean
    token (or `noise.noisy_ids`, L-EBPO); scored = the positions that carry a log-prob term; targets = the
    scored action (`noise.targets`), or the clean token (then returned as `input_ids` expanded). Mask-only
    draws take exactly the operations they always took, so their composites stay bit for bit what they were.
    """
    dev = input_ids.device
    idx = torch.as_tensor(list(draws), device=noise.masked.device, dtype=torch.long)
    masked = noise.masked.index_select(0, idx).to(dev)  # (S, B, L)
    weight = noise.weight.index_select(0, idx).to(dev)
    visible = input_ids[None]
    if noise.substituted is not None:
        sub = noise.substituted.index_select(0, idx).to(dev)
        visible = torch.where(sub, noise.sub_ids.index_select(0, idx).to(dev).to(input_ids.dtype), visible)
    noisy = torch.where(masked, torch.full((), mask_token_id, device=dev, dtype=input_ids.dtype), visible)
    if noise.noisy_ids is not None:
        noisy = noise.noisy_ids.index_select(0, idx).to(dev).to(input_ids.dtype)
    targets = None if noise.targets is None else noise.targets.index_select(0, idx).to(dev)
    return noisy, (masked if noise.substituted is None else masked | sub), weight, targets


def composite_logprobs(model, input_ids: torch.Tensor, noise: NoiseDraws, draws: Sequence[int], mask_token_id: int,
                       packed: bool = False, return_blocks: bool = False, use_module_head: bool = False):
    """Composites C (B, S) of the draws `draws` (S of them) in one forward.

    input_ids (B, L) long (clean sequences); noise: `NoiseDraws` of these B sequences.
    packed=False: batch (S*B, 2L) of `[noisy_s ; clean]`; packed=True: (B, (S+1)L) `[noisy_1..noisy_S ; clean]`.
    Both use the masks of `ebpo.model.masks` and position ids 0..L-1 per copy. Gradient flows if enabled.
    return_blocks=True also returns per-block contributions (B, S, nb) whose sum over blocks is C.
    """
    B, L = input_ids.shape
    K = noise.block_size
    S = len(draws)
    dev = input_ids.device
    noisy, scored, weight, targets = _noisy_inputs(noise, draws, input_ids, mask_token_id)  # (S, B, L) each
    if packed:
        ids = torch.cat([noisy.permute(1, 0, 2).reshape(B, S * L), input_ids], dim=1)  # (B, (S+1)L)
        keep = packed_noisy_clean_mask(L, K, S, device=dev)[None, None]
        pos = noisy_clean_position_ids(L, S, device=dev)
        h = unwrap_hidden(model(input_ids=ids, attention_mask=keep, position_ids=pos, return_logits=False))
        h_noisy = h[:, : S * L].reshape(B, S, L, -1).transpose(0, 1)  # (S, B, L, H)
    else:
        ids = torch.cat([noisy, input_ids[None].expand(S, B, L)], dim=2).reshape(S * B, 2 * L)
        keep = packed_noisy_clean_mask(L, K, 1, device=dev)[None, None]
        pos = noisy_clean_position_ids(L, 1, device=dev)
        h = unwrap_hidden(model(input_ids=ids, attention_mask=keep, position_ids=pos, return_logits=False))
        h_noisy = h[:, :L].reshape(S, B, L, -1)
    return _scatter_composites(model, h_noisy, input_ids, scored, weight, K, return_blocks, use_module_head, targets)


def _scatter_composites(model, h_noisy, input_ids, scored, weight, K, return_blocks, use_module_head, targets=None):
    """h_noisy (S, B, L, H), scored/weight (S, B, L) -> C (B, S) [and per-block terms (B, S, nb)].

    targets: None (score the clean token) or (S, B, L) long, the action scored at each position (L-EBPO)."""
    S, B, L = scored.shape
    # Gather only loss positions before the LM head: (M, H) rows instead of S*B*L*V logits.
    sel = scored.nonzero(as_tuple=True)  # (s, b, l) indices
    tgt = input_ids[sel[1], sel[2]] if targets is None else targets[sel]
    logp = gathered_logprobs(model, h_noisy[sel], tgt, use_module_head)
    contrib = logp * weight[sel]
    nb = (L + K - 1) // K
    flat = (sel[1] * S + sel[0]) * nb + torch.div(sel[2], K, rounding_mode="floor")
    blocks = torch.zeros(B * S * nb, device=h_noisy.device, dtype=contrib.dtype).index_add(0, flat, contrib)
    blocks = blocks.view(B, S, nb)
    comp = blocks.sum(-1)
    return (comp, blocks) if return_blocks else comp


@torch.no_grad()
def composite_logprobs_cached(model, input_ids: torch.Tensor, noise: NoiseDraws, draws: Sequence[int],
                              mask_token_id: int, return_blocks: bool = False, use_module_head: bool = False,
                              by_block: bool = True, group_tokens: int = 2048):
    """Composites (B, S) without grad, with the clean copy's keys/values in a KV cache.

    Same attention pattern as `[noisy_s ; clean]` (noisy block b sees clean blocks < b and itself).
    by_block=True (default): forward b runs block b of the S noisy copies and of the clean copy ((S+1)B
    rows of K tokens) against the clean blocks < b already cached, then commits the clean rows. Each row
    attends exactly the keys the mask allows (no score is computed and thrown away) and the S+1 copies
    of a sequence read its cached prefix in place (`kernels.attention.shared_prefix_attention`); the
    clean copy's last block, which no noisy block sees, is skipped, and so are noisy blocks in which no
    copy masks anything (prompt blocks). nb forwards of (S+1)BK tokens.
    by_block=False: the clean copy once, then all S noisy copies in one forward whose queries attend 2L
    keys through a dense mask (fewer forwards, about 4x the attention scores).
    Keys/values are cached detached: no-grad passes only.
    """
    B, L = input_ids.shape
    K = noise.block_size
    S = len(draws)
    dev = input_ids.device
    cfg = model.config
    cache = BlockKVCache.for_model(cfg, B, L, dtype=model.get_output_embeddings().weight.dtype, device=dev)
    noisy, scored, weight, targets = _noisy_inputs(noise, draws, input_ids, mask_token_id)  # (S, B, L) each
    if by_block:
        nb = (L + K - 1) // K
        padded = torch.zeros(S, B, nb * K, dtype=torch.bool, device=dev)
        padded[..., :L] = scored
        live = padded.view(S, B, nb, K).any(-1).any(1).any(0).tolist()  # (nb,) one host sync
        first = next((b for b in range(nb) if live[b]), nb)  # leading blocks no copy masks (prompt blocks)
        if first:  # clean only: keys/values for the blocks after them
            model(input_ids=input_ids[:, : first * K], attention_mask=CopyBlockLayout(1, K),
                  position_ids=torch.arange(first * K, device=dev), cache=cache, return_logits=False)
            cache.commit(first * K)
        G = max(1, group_tokens // max(1, (S + 1) * B * K))  # blocks per forward
        h_noisy = [torch.zeros(S, B, min(first * K, L), cfg.hidden_size, device=dev, dtype=cache.k[0].dtype)]
        rows = list(range(B)) * (S + 1)
        for b in range(first, nb, G):
            lo, hi = b * K, min((b + G) * K, L)
            x = torch.cat([noisy[:, :, lo:hi].reshape(S * B, hi - lo), input_ids[:, lo:hi]])
            h = unwrap_hidden(model(input_ids=x, attention_mask=CopyBlockLayout(S + 1, K),
                                     position_ids=torch.arange(lo, hi, device=dev), cache=cache,
                                     cache_rows=rows, return_logits=False))
            if hi < L:
                cache.commit([0] * (S * B) + [hi - lo] * B)
            h_noisy.append(h[: S * B].view(S, B, hi - lo, -1))
        h = torch.cat(h_noisy, 2)
        return _scatter_composites(model, h, input_ids, scored, weight, K, return_blocks, use_module_head, targets)
    pos = torch.arange(L, device=dev)
    model(input_ids=input_ids, attention_mask=block_causal_mask(L, K, device=dev)[None, None], position_ids=pos,
          cache=cache, return_logits=False)
    cache.commit(L)
    # Rows of `[noisy ; clean]`'s noisy half, columns reordered to [clean prefix (cache) ; noisy (new)].
    full = packed_noisy_clean_mask(L, K, 1, device=dev)[:L]
    keep = torch.cat([full[:, L:], full[:, :L]], dim=1)[None, None]
    rows = [b for _ in range(S) for b in range(B)]
    h = unwrap_hidden(model(input_ids=noisy.reshape(S * B, L), attention_mask=keep, position_ids=pos,
                             cache=cache, cache_rows=rows, return_logits=False)).reshape(S, B, L, -1)
    return _scatter_composites(model, h, input_ids, scored, weight, K, return_blocks, use_module_head, targets)


def composite_logprobs_blockwise(model, input_ids: torch.Tensor, noise: NoiseDraws, draw: int, mask_token_id: int,
                                 use_module_head: bool = False) -> torch.Tensor:
    """Baseline: the composite (B,) of one draw scored block by block, one forward per block.

    For every block b holding a scored response token, forward `[clean blocks < b ; noisy block b]`
    with the model's default block-causal mask. Slow (sum over blocks of (b+1)K tokens); used by the
    benchmark as the per-block loop the vectorized layout replaces.
    """
    B, L = input_ids.shape
    K = noise.block_size
    dev = input_ids.device
    noisy, scored, weight, targets = (None if x is None else x[0]
                                      for x in _noisy_inputs(noise, [draw], input_ids, mask_token_id))
    comp = torch.zeros(B, device=dev, dtype=torch.float32)  # the composites are fp32 whatever the default dtype
    for b in range((L + K - 1) // K):
        lo, hi = b * K, min((b + 1) * K, L)
        m = scored[:, lo:hi]
        if not m.any():
            continue
        noisy_block = noisy[:, lo:hi]
        ids = torch.cat([input_ids[:, :lo], noisy_block], dim=1)
        h = unwrap_hidden(model(input_ids=ids, attention_mask=block_causal_mask(hi, K, device=dev)[None, None],
                                 position_ids=torch.arange(hi, device=dev), return_logits=False))[:, lo:hi]
        rows, cols = m.nonzero(as_tuple=True)
        tgt = input_ids[rows, lo + cols] if targets is None else targets[rows, lo + cols]
        logp = gathered_logprobs(model, h[rows, cols], tgt, use_module_head)
        comp = comp.index_add(0, rows, logp * weight[rows, lo + cols])
    return comp


def all_composites(model, input_ids: torch.Tensor, noise: NoiseDraws, mask_token_id: int, packed: bool = False,
                   chunk: int = 0, return_blocks: bool = False, use_module_head: bool = False, cached: bool = False):
    """Composites (B, N) of every draw, `chunk` draws per forward (0 = all N in one forward).

    Runs under whatever grad mode the caller chose; `cached=True` uses `composite_logprobs_cached`
    (no grad only; `packed` is then ignored). With return_blocks, also (B, N, nb).
    """
    N = noise.n_draws
    step = N if chunk <= 0 else chunk
    outs, blocks = [], []
    for lo in range(0, N, step):
        draws = list(range(lo, min(lo + step, N)))
        if cached:
            r = composite_logprobs_cached(model, input_ids, noise, draws, mask_token_id, return_blocks=return_blocks,
                                          use_module_head=use_module_head)
        else:
            r = composite_logprobs(model, input_ids, noise, draws, mask_token_id, packed=packed,
                                   return_blocks=return_blocks, use_module_head=use_module_head)
        if return_blocks:
            outs.append(r[0])
            blocks.append(r[1])
        else:
            outs.append(r)
    comp = torch.cat(outs, dim=1)
    return (comp, torch.cat(blocks, dim=1)) if return_blocks else comp


# ----------------------------------------------------------------------------------------------------
# Gradient replay
# ----------------------------------------------------------------------------------------------------

def replay_backward(model, input_ids: torch.Tensor, noise: NoiseDraws, mask_token_id: int,
                    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
                    backward: Callable[[torch.Tensor], None] | None = None, packed: bool = False,
                    nograd_chunk: int = 0, replay_chunk: int = 1, use_module_head: bool = False,
                    cached: bool = False, return_blocks: bool = False):
    """Exact gradient of `loss_fn(C)` with the activations of only `replay_chunk` draws alive at a time.

    1. C (B, N) = composites of all draws without grad (`nograd_chunk` draws per forward; `cached`
       selects `composite_logprobs_cached` for this pass);
    2. loss, metrics = loss_fn(C_leaf) with C_leaf a leaf requiring grad; g = dloss/dC (B, N);
    3. for each chunk of draws S: recompute C_S with grad and backpropagate (C_S * g[:, S]).sum().
    By the chain rule the accumulated parameter gradient equals that of loss_fn(C) backpropagated
    directly. `backward(t)` defaults to `t.backward()` (DeepSpeed passes `engine.backward`).
    Returns (loss detached, metrics, C (B, N) detached); with `return_blocks` the last item is
    (C, per-block composites (B, N, nb)) from the no-grad pass.
    """
    backward = backward or (lambda t: t.backward())
    with torch.no_grad():
        comp = all_composites(model, input_ids, noise, mask_token_id, packed=packed, chunk=nograd_chunk,
                              use_module_head=use_module_head, cached=cached, return_blocks=return_blocks)
    comp, blocks = comp if return_blocks else (comp, None)
    leaf = comp.detach().requires_grad_(True)
    with torch.enable_grad():
        loss, metrics = loss_fn(leaf)
        (grad,) = torch.autograd.grad(loss, leaf)
    N = noise.n_draws
    step = max(1, replay_chunk)
    for lo in range(0, N, step):
        draws = list(range(lo, min(lo + step, N)))
        c = composite_logprobs(model, input_ids, noise, draws, mask_token_id, packed=packed,
                               use_module_head=use_module_head)
        backward((c * grad[:, lo: lo + len(draws)]).sum())
    return loss.detach(), metrics, ((comp, blocks) if return_blocks else comp)


def direct_backward(model, input_ids: torch.Tensor, noise: NoiseDraws, mask_token_id: int,
                    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
                    backward: Callable[[torch.Tensor], None] | None = None, packed: bool = False,
                    use_module_head: bool = False, return_blocks: bool = False):
    """Reference path: all N draws in one forward with grad, one backward (memory grows with N).

    Returns (loss detached, metrics, C (B, N) detached); with `return_blocks` the last item is
    (C, per-block composites (B, N, nb)), both detached.
    """
    backward = backward or (lambda t: t.backward())
    comp = all_composites(model, input_ids, noise, mask_token_id, packed=packed, chunk=0,
                          use_module_head=use_module_head, return_blocks=return_blocks)
    comp, blocks = comp if return_blocks else (comp, None)
    loss, metrics = loss_fn(comp)
    backward(loss)
    if return_blocks:
        return loss.detach(), metrics, (comp.detach(), blocks.detach())
    return loss.detach(), metrics, comp.detach()
