"""A decoding loop shaped like the released LLaDA2.x `generate()`: the baseline of `ebpo bench decode --vs-released`.

The released Hugging Face code decodes one prompt at a time, and every iteration of the active block runs
the model over the whole canvas up to the block's end (no KV cache) with the block-causal mask, takes full
logits and reads the active block's rows. This loop keeps that structure - batch 1, no cache, full
forward, full logits - and makes the same decisions as `rollout.generate` (the same candidate function,
`rollout.steps.block_step` / `block_done`, the same EOS rule), so the two give the same tokens and the
benchmark compares only how the work is organised. Greedy or sampled (one generator per prompt), no MBE.
"""
from __future__ import annotations

import torch

from ebpo.model.masks import block_causal_mask


@torch.no_grad()
def released_style_generate(model, prompt: list[int], cfg, generator: torch.Generator | None = None) -> list[int]:
    """Generated tokens of one prompt (cut after the first EOS, like `GenerationOutput.token_ids`)."""
    from rollout.sampling import candidates
    from rollout.steps import block_done, block_step, first_eos, penalty_targets

    mcfg = model.config
    K = cfg.block_size or mcfg.block_size
    mask_id, M = int(mcfg.mask_token_id), cfg.max_new_tokens
    eos = mcfg.eos_token_id
    eos_ids = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    dev = next(model.parameters()).device
    P = len(prompt)
    T = -(-(P + M) // K) * K
    x = torch.full((1, T), mask_id, dtype=torch.long, device=dev)
    x[0, :P] = torch.tensor(prompt, dtype=torch.long, device=dev)
    full_mask = block_causal_mask(T, K, device=dev)[None, None]
    positions = torch.arange(T, device=dev)[None]
    cap = K + cfg.max_post_steps + 1
    for b in range(P // K, T // K):
        lo, hi = b * K, (b + 1) * K
        post_steps = torch.zeros(1, dtype=torch.long, device=dev)
        iters = 0
        protected = (torch.arange(lo, hi, device=dev) < P)[None]
        while True:
            logits = model(x[:, :hi], attention_mask=full_mask[:, :, :hi, :hi], position_ids=positions[:, :hi]).logits
            block_logits = logits[:, lo:hi].clone()
            block_logits[..., mask_id] = float("-inf")
            suppress = None
            if cfg.repetition_penalty:
                pos = torch.arange(lo, hi, device=dev)[None]
                prev = x[:, (pos[0] - 1).clamp(min=0)].masked_fill(pos == 0, mask_id)
                suppress = penalty_targets(prev, mask_id)
            tok, prob = candidates(block_logits, cfg.temperature, cfg.top_k, cfg.top_p,
                                   [generator] if generator is not None else None, suppress, cfg.repetition_penalty)
            cur = x[:, lo:hi]
            res = block_step(tok, prob, cur, protected, mask_id, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
            iters += 1
            done, post_steps = block_done(res, post_steps, torch.tensor([iters], device=dev), cfg.max_post_steps, cap,
                                          cfg.editing)
            x[:, lo:hi] = res.new
            if bool(done):
                break
        region = x[0, P:min(P + M, hi)].tolist()
        if cfg.stop_at_eos and first_eos(region, eos_ids) is not None:
            break
    out = x[0, P:P + M].tolist()
    cut = first_eos(out, eos_ids)
    return out if cut is None else out[: cut + 1]
