"""The compiled decode step of the rollout engine: fixed shapes, no host synchronisation, for `torch.compile`
and CUDA graphs.

With `DecodeConfig(compiled_step=True)` the engine (`rollout.engine`) runs the rows that decode a block as
one function of tensors whose shapes never change: all `max_batch` slots, block K, canvas T, cache T + K.

    step(state, noise) -> (B, 7) per-slot outcome       (one host synchronisation reads it)

  1. every slot runs a window of 2K tokens: its previous block, recomputed, and its active block, at their
     absolute positions; their keys/values are written in place into a `StaticKVCache`, whose slots before
     the window hold the row's committed prefix (a row in its first block, with no previous block, puts
     dummy tokens in a spare tail of the cache that no other query attends);
  2. attention over the whole cache buffer through a keep-mask built on the device from the row's block
     index;
  3. candidates (greedy, or Gumbel-max from noise drawn beforehand from each row's own generator: the same
     numbers the eager path draws), M2T / T2T (`rollout.steps`), DELETE / INSERT (`rollout.levenshtein`),
     the write, the trace and the block-end rule (early commit included) - all with `torch.where`, never a
     branch on a device value. Slots not taking part run too (shapes stay fixed) and change nothing.

The scheduler does the rest on the host, as for eager rows, from the outcome it reads once per iteration:
what a block's end means (next block, EOS, end of turn, MBE window), admission, environments. Keys/values
the step cannot produce by itself are written by `refill`, an eager block-causal forward over one slot's
blocks: a new sequence's prompt blocks, a turn's last block and the observation after it, the blocks a
Multi-Block Editing pass changed. MBE passes themselves run eagerly (their window is one enlarged block, a
shape of its own) and without the cache: they recompute the prefix, which is exact.

Run uncompiled (`COMPILE = False`), the step gives the eager loop's tokens, forward counts, edits and traces
bit for bit (tests check it); compiled by inductor, whose fused kernels round differently, a near-tie can be
decided one iteration apart. The edit log (`GenerationOutput.edit_log`) stays empty here: the step keeps
counts only. The step is compiled with `torch.compile(fullgraph=True, dynamic=False)` once per model, batch
shape and setting; `tests/rollout/test_compiled_step.py` checks there is no graph break and no
recompilation across the iterations, blocks and admissions of a run.
"""
from __future__ import annotations

import types

import torch

from ebpo.model.cache import StaticKVCache

from .levenshtein import DEL, INS, edit_probs, levenshtein_block_step, shift_trace
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
    """One block iteration of every slot with fixed shapes (module docstring); `__call__` returns
    (outcome (B, 6) long: block done, wrote, EOS in the generated region, T2T edits, DELETEs, INSERTs;
    cur (B, K) long: each active block before the iteration, L-EBPO's pre-edit draft when an operation ran).

    Mutated in place: canvas (B, T), trace (B, T), post_steps, block_iters (B,). Inputs built by the host each
    iteration: block, start (first writable position), limit (max new tokens), forwards (B,) long, active (B,)
    bool, noise (B, K, V) uniforms (`draw_noise`), or None when greedy (`cfg.temperature == 0` never reads it).
    """

    def __init__(self, model, cfg, K: int, T: int, mask_id: int, eos_ids: set[int], cache: StaticKVCache,
                 lev_ids: tuple[int, int] | None):
        self.model, self.cfg, self.K, self.T, self.mask_id = model, cfg, K, T, mask_id
        self.cache, self.lev_ids = cache, lev_ids
        self.eos = sorted(eos_ids)
        self.block_cap = K + cfg.max_post_steps + 1

    def _window_hidden(self, canvas, block):
        """Hidden states (B, K, H) of the active blocks after a forward over [previous block ; active block]."""
        K, T, dev = self.K, self.T, canvas.device
        ar = torch.arange(K, device=dev)
        act_lo = block * K
        has_prev = block > 0
        prev_lo = torch.where(has_prev, act_lo - K, torch.full_like(act_lo, T))  # no previous block: spare tail
        win = torch.cat([prev_lo[:, None] + ar, act_lo[:, None] + ar], 1)  # (B, 2K) absolute slots
        in_tail = win >= T
        ids = torch.where(in_tail, self.mask_id, canvas.gather(1, win.clamp(max=T - 1)))
        pos_ids = torch.where(in_tail, win - T, win)
        j = torch.arange(T + K, device=dev)[None]
        keep_prev = torch.where(has_prev[:, None], j < act_lo[:, None], j >= T)  # (B, T + K)
        keep_act = j < (act_lo + K)[:, None]
        keep = torch.cat([keep_prev[:, None].expand(-1, K, -1), keep_act[:, None].expand(-1, K, -1)], 1)[:, None]
        self.cache.write_pos = win
        return self.model(input_ids=ids, attention_mask=keep, position_ids=pos_ids, cache=self.cache,
                          return_logits=False).last_hidden_state[:, K:]

    def __call__(self, canvas, trace, post_steps, block_iters, block, start, limit, forwards, active, noise):
        cfg, K, mask_id = self.cfg, self.K, self.mask_id
        logits = self.model.lm_head(self._window_hidden(canvas, block)).float()
        logits[..., mask_id] = float("-inf")  # as in the eager loop: a written token is never <|mask|>
        eprob = None
        if self.lev_ids is not None:
            eprob = edit_probs(logits, *self.lev_ids)
            logits[..., list(self.lev_ids)] = float("-inf")
        pos = (block * K)[:, None] + torch.arange(K, device=canvas.device)  # (B, K)
        suppress = None
        if cfg.repetition_penalty:
            prev = canvas.gather(1, (pos - 1).clamp(min=0)).masked_fill(pos == 0, mask_id)
            suppress = penalty_targets(prev, mask_id)
        tok, prob = _candidates(logits, noise, cfg.temperature, cfg.top_k, cfg.top_p, suppress,
                                cfg.repetition_penalty)
        cur = canvas.gather(1, pos)
        protected = pos < start[:, None]
        lstep = None
        iters = block_iters + active.long()
        if self.lev_ids is not None:
            lstep = levenshtein_block_step(tok, prob, eprob, cur, protected, mask_id, cfg,
                                           ops_allowed=iters < self.block_cap)
            res = lstep.result
        else:
            res = block_step(tok, prob, cur, protected, mask_id, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
        done, new_post = block_done(res, post_steps, iters, cfg.max_post_steps, self.block_cap,
                                    cfg.editing or cfg.levenshtein, prob, cfg.early_commit)
        if lstep is not None:  # never commit a [MASK]: past the cap a shifted-in slot is filled first
            done = done & (res.masks_left == 0)
        act = active[:, None]
        canvas.scatter_(1, pos, torch.where(act, res.new, cur))
        old_trace = trace.gather(1, pos)
        new_trace = (shift_trace(old_trace, lstep, forwards[:, None]) if lstep is not None
                     else torch.where(res.m2t | res.t2t, forwards[:, None], old_trace))
        trace.scatter_(1, pos, torch.where(act, new_trace, old_trace))
        post_steps.copy_(torch.where(active, new_post, post_steps))
        block_iters.copy_(iters)
        zero = torch.zeros_like(block)
        ops = lstep.ops if lstep is not None else None
        outcome = torch.stack([
            (done & active).long(), ((res.m2t | res.t2t) & act).any(-1).long(), self._has_eos(canvas, block, start, limit),
            (res.t2t & act).sum(-1), zero if ops is None else ((ops == DEL) & act).sum(-1),
            zero if ops is None else ((ops == INS) & act).sum(-1)], -1)
        return outcome, cur

    def _has_eos(self, canvas, block, start, limit):
        """(B,) long: EOS in the generated region [start, min(start + limit, block end)) (limit: (B,) long, the
        sequence's max_new_tokens)."""
        col = torch.arange(self.T, device=canvas.device)[None]
        gen_end = torch.minimum(start + limit, (block + 1) * self.K)
        region = (col >= start[:, None]) & (col < gen_end[:, None])
        is_eos = torch.zeros_like(region)
        for e in self.eos:
            is_eos = is_eos | (canvas == e)
        return (region & is_eos).any(-1).long()


def compiled_step(step: StaticDecodeStep):
    """`torch.compile(step, fullgraph=True, dynamic=False)` with `BACKEND` / `MODE`, kept per (model, settings,
    shapes) so that later `generate` calls with the same batch shape reuse the compiled graph. Each key gets
    its own code object, so dynamo's per-code recompile limit never pushes a new shape back to eager."""
    if not COMPILE:
        return step
    key = (id(step.model), step.cfg, step.K, step.T, step.cache.k[0].shape[0], step.lev_ids, BACKEND, MODE)
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


def check_supported(cfg, on_step) -> None:
    """Raise ValueError for what the fixed-shape step cannot do: run without its cache, or report every
    forward's decisions to `on_step` (they stay on the device)."""
    if not cfg.use_cache:
        raise ValueError("DecodeConfig.compiled_step needs use_cache=true (the step attends a fixed-size KV cache)")
    if on_step is not None:
        raise ValueError("generate: on_step needs the eager step (compiled_step=false): the compiled step "
                         "keeps every sequence's per-forward decisions on the device")


def draw_noise(gens, live: list[bool], shape, device) -> torch.Tensor:
    """Uniforms (B, K, V) for Gumbel-max: row b's from gens[b] only, and only while it is live (the eager
    decoder draws for a row exactly when the row takes part in a forward)."""
    out = torch.zeros(len(gens), *shape, device=device)
    for b, g in enumerate(gens):
        if live[b]:
            out[b] = torch.rand(shape, generator=g, device=g.device, dtype=torch.float32).to(device)
    return out
