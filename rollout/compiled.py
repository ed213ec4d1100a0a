"""A decode step with fixed shapes and no host synchronisation, for `torch.compile` and CUDA graphs.

`DecodeConfig(compiled_step=True)` makes `generate` run this loop instead of the eager one: same algorithm,
and, run uncompiled, the same tokens, forward counts, edits and traces bit for bit (tests check it; compiled
by inductor, whose fused kernels round differently, a near-tie can be decided one iteration apart), but one
block iteration of every sequence is a single function of tensors whose shapes never change during a
`generate` call:

    step(state, noise) -> all_finished          (B rows, block K, canvas T, cache T + K slots)

  1. every row runs a window of 2K tokens: its previous block, recomputed, and its active block, at their
     absolute positions; their keys/values are written in place into a `StaticKVCache`, whose slots before
     the window hold the row's committed prefix (a row in its first block, with no previous block, puts
     dummy tokens in a spare tail of the cache that no other query attends);
  2. attention over the whole cache buffer through a keep-mask built on the device from the row's block
     index (prefix and previous block for the previous block's queries; everything up to the active
     block's end for the active block's);
  3. candidates (greedy, or Gumbel-max from noise drawn beforehand from each row's own generator: the same
     numbers the eager path draws, so sampling matches it too), M2T / T2T (`rollout.steps`), the write,
     the trace, the block-end rule, EOS and the move to the next block - all with `torch.where`, never a
     branch on a device value. Finished rows keep running (shapes stay fixed) and change nothing.

Recomputing the previous block makes its cached keys/values final whatever the block's last iteration
wrote, so the eager decoder's commit logic (ride-along of a finished block, prompt blocks folded into the
first forward) is not needed; the eager decoder does not count that ride-along as a forward, nor does
this loop. The prompt's whole blocks are prefilled once, eagerly, before the loop. The only host
synchronisation per iteration is the termination check (`(~finished).tolist()`, which also says whose
generator the sampler draws from next: the noise for a step is drawn on the host from each live row's own
generator before the step - RNG calls, not a sync).

Not supported here (the eager decoder handles them): Multi-Block Editing, `use_cache=False`, `on_step`.
The step is compiled with `torch.compile(fullgraph=True, dynamic=False)` once per model, batch shape and
setting; `tests/rollout/test_compiled_step.py` checks there is no graph break and no recompilation
across the iterations and blocks of a batch.
"""
from __future__ import annotations

import types

import torch

from ebpo.model.cache import StaticKVCache

from .sampling import filter_top_k_top_p
from .steps import block_done, block_step, penalty_targets

_COMPILED: dict = {}
COMPILE = True  # False runs the same fixed-shape step eagerly (tests of the algorithm without compile time)
BACKEND = "inductor"  # torch.compile backend; "aot_eager" traces the same graph and runs eager kernels
MODE = None  # torch.compile mode; "reduce-overhead" adds CUDA graphs on a GPU
BUCKET_BLOCKS = 16  # canvas lengths are rounded up to this many blocks (fewer distinct compiled shapes)


def _candidates(logits, noise, temperature: float, top_k: int, top_p: float, suppress, penalty: float):
    """The eager path's candidate maths (`rollout.sampling.candidates_reference`, equal to the torch path of
    `kernels.decode.candidates`) with the Gumbel noise given as uniforms `noise` (B, K, V)."""
    x = logits.float()
    if suppress is not None and penalty:
        valid = (suppress >= 0).to(x.dtype)
        x = x.scatter_add(-1, suppress.clamp_min(0).long()[..., None], (-penalty * valid)[..., None])
    if temperature == 0.0:
        tok = x.argmax(-1)
    else:
        x = filter_top_k_top_p(x / temperature, top_k, top_p)
        gumbel = -torch.log(-torch.log(noise.clamp_min(torch.finfo(torch.float32).tiny)))
        tok = (x + gumbel).argmax(-1)
    prob = (x.gather(-1, tok[..., None]).squeeze(-1) - torch.logsumexp(x, -1)).exp()
    return tok, prob


class StaticDecodeStep:
    """The per-iteration function and its fixed settings; `__call__` runs one block iteration of every row.

    State tensors (mutated in place): canvas (B, T) long, trace (B, T) long, block, post_steps,
    block_iters, forwards, edits (B,) long, finished (B,) bool. Constants: prompt_len, num_blocks (B,).
    """

    def __init__(self, model, cfg, K: int, T: int, mask_id: int, eos_ids: set[int], cache: StaticKVCache):
        self.model, self.cfg, self.K, self.T, self.mask_id = model, cfg, K, T, mask_id
        self.cache = cache
        self.eos = sorted(eos_ids)
        self.block_cap = K + cfg.max_post_steps + 1

    def __call__(self, canvas, trace, block, post_steps, block_iters, forwards, edits, finished, prompt_len,
                 num_blocks, noise):
        cfg, K, T, mask_id = self.cfg, self.K, self.T, self.mask_id
        dev = canvas.device
        ar = torch.arange(K, device=dev)
        act_lo = block * K  # (B,)
        has_prev = block > 0
        prev_lo = torch.where(has_prev, act_lo - K, torch.full_like(act_lo, T))  # no previous block: spare tail
        win = torch.cat([prev_lo[:, None] + ar, act_lo[:, None] + ar], 1)  # (B, 2K) absolute slots
        in_tail = win >= T
        ids = torch.where(in_tail, mask_id, canvas.gather(1, win.clamp(max=T - 1)))
        pos_ids = torch.where(in_tail, win - T, win)
        j = torch.arange(T + K, device=dev)[None]
        keep_prev = torch.where(has_prev[:, None], j < act_lo[:, None], j >= T)  # (B, T + K)
        keep_act = j < (act_lo + K)[:, None]
        keep = torch.cat([keep_prev[:, None].expand(-1, K, -1), keep_act[:, None].expand(-1, K, -1)], 1)[:, None]
        self.cache.write_pos = win
        h = self.model(input_ids=ids, attention_mask=keep, position_ids=pos_ids, cache=self.cache,
                       return_logits=False).last_hidden_state[:, K:]
        logits = self.model.lm_head(h).float()
        logits[..., mask_id] = float("-inf")  # as in the eager decoder: a written token is never <|mask|>
        pos = act_lo[:, None] + ar  # (B, K)
        suppress = None
        if cfg.repetition_penalty:
            prev = canvas.gather(1, (pos - 1).clamp(min=0)).masked_fill(pos == 0, mask_id)
            suppress = penalty_targets(prev, mask_id)
        tok, prob = _candidates(logits, noise, cfg.temperature, cfg.top_k, cfg.top_p, suppress,
                                cfg.repetition_penalty)
        cur = canvas.gather(1, pos)
        protected = pos < prompt_len[:, None]
        res = block_step(tok, prob, cur, protected, mask_id, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
        active = ~finished
        iters = block_iters + active.long()
        done, new_post = block_done(res, post_steps, iters, cfg.max_post_steps, self.block_cap, cfg.editing)
        done = done & active
        written = (res.m2t | res.t2t) & active[:, None]
        canvas.scatter_(1, pos, torch.where(active[:, None], res.new, cur))
        trace.scatter_(1, pos, torch.where(written, forwards[:, None], trace.gather(1, pos)))
        edits += (res.t2t & active[:, None]).sum(-1)
        forwards += active.long()
        # block end: EOS in the generated region (up to max_new_tokens) stops the row, else the next block
        col = torch.arange(T, device=dev)[None]
        gen_end = torch.minimum(prompt_len + cfg.max_new_tokens, (block + 1) * K)
        region = (col >= prompt_len[:, None]) & (col < gen_end[:, None])
        is_eos = torch.zeros_like(region)
        for e in self.eos:
            is_eos = is_eos | (canvas == e)
        has_eos = (region & is_eos).any(-1)
        stop = done & ((has_eos & cfg.stop_at_eos) | (block + 1 >= num_blocks))
        advance = done & ~stop
        finished |= stop
        block += advance.long()
        post_steps.copy_(torch.where(advance, 0, torch.where(active, new_post, post_steps)))
        block_iters.copy_(torch.where(advance, 0, iters))
        return finished.all()


def compiled_step(step: StaticDecodeStep):
    """`torch.compile(step, fullgraph=True, dynamic=False)` with `BACKEND` / `MODE`, kept per (model, settings,
    shapes) so that later `generate` calls with the same batch shape reuse the compiled graph. Each key gets
    its own code object, so dynamo's per-code recompile limit never pushes a new shape back to eager."""
    if not COMPILE:
        return step
    key = (id(step.model), step.cfg, step.K, step.T, step.cache.k[0].shape[0], BACKEND, MODE)
    fn = _COMPILED.get(key)
    if fn is None:
        code = _call.__code__.replace(co_name=f"_decode_step_{len(_COMPILED)}")
        fresh = types.FunctionType(code, _call.__globals__, code.co_name)
        fn = torch.compile(fresh, fullgraph=True, dynamic=False, backend=BACKEND, mode=MODE)
        _COMPILED[key] = fn
    return lambda *args: fn(step, *args)


def _call(step, *args):
    return step(*args)


def canvas_length(prompt_lens: list[int], max_new_tokens: int, K: int) -> int:
    """Canvas length T of a batch, rounded up to a whole number of BUCKET_BLOCKS blocks so that batches with
    slightly different prompt lengths share one compiled step (the extra slots are masked out)."""
    need = max(-(-(P + max_new_tokens) // K) for P in prompt_lens)
    return -(-need // BUCKET_BLOCKS) * BUCKET_BLOCKS * K


def prefill(model, canvas: torch.Tensor, prompt_lens: list[int], K: int, cache: StaticKVCache) -> None:
    """Keys/values of every row's whole prompt blocks into the cache, block-causally (one eager forward)."""
    n_pre = [p // K * K for p in prompt_lens]
    L = max(n_pre)
    if L == 0:
        return
    dev = canvas.device
    pos = torch.arange(L, device=dev)
    blk_end = (pos // K + 1) * K  # a query attends every key before its block's end
    keep = torch.arange(cache.max_len, device=dev)[None, :] < blk_end[:, None]  # (L, T + K)
    keep = keep[None, None].expand(canvas.shape[0], 1, L, cache.max_len)
    cache.write_pos = pos[None].expand(canvas.shape[0], L)
    # rows with fewer prompt blocks compute junk past them; those slots are rewritten before anyone reads them
    model(input_ids=canvas[:, :L], attention_mask=keep, position_ids=pos, cache=cache, return_logits=False)


def check_supported(cfg, on_step) -> None:
    if cfg.mbe_window > 0:
        raise ValueError("DecodeConfig.compiled_step: Multi-Block Editing (mbe_window > 0) runs only in the eager "
                         "decoder; set compiled_step=false")
    if cfg.early_commit is not None:
        raise ValueError("DecodeConfig.compiled_step: early_commit runs only in the eager decoder; set "
                         "compiled_step=false")
    if cfg.levenshtein:
        raise ValueError("DecodeConfig.compiled_step: Levenshtein editing (tau_delete / tau_insert) runs only in the "
                         "eager decoder; set compiled_step=false")
    if not cfg.use_cache:
        raise ValueError("DecodeConfig.compiled_step needs use_cache=true (the step attends a fixed-size KV cache)")
    if on_step is not None:
        raise ValueError("generate: on_step needs the eager decoder (compiled_step=false): the compiled step "
                         "keeps every sequence's state on the device")


def draw_noise(gens, live: list[bool], shape, device) -> torch.Tensor:
    """Uniforms (B, K, V) for Gumbel-max: row b's from gens[b] only, and only while it is live (the eager
    decoder draws for a row exactly when the row takes part in a forward)."""
    out = torch.zeros(len(gens), *shape, device=device)
    for b, g in enumerate(gens):
        if live[b]:
            out[b] = torch.rand(shape, generator=g, device=g.device, dtype=torch.float32).to(device)
    return out
