"""`generate`: the batched draft-and-edit decoder (LLaDA2.1 joint thresholds) with a prefix KV cache.

Every sequence keeps its own state (active block, post-step counter, MBE pass, finished) and all
unfinished sequences advance together: one model call per loop iteration runs, for each of them, the
canvas slice described in `rollout.layout`. Finished sequences leave the batch (`cache_rows`).
Per-step decisions are the pure functions of `rollout.steps`; candidates come from `rollout.sampling`.
docs/decoding.md explains the algorithm and the reading of the block-end rule.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from ebpo.model import BlockKVCache
from ebpo.model.cache import StaticKVCache

from .compiled import StaticDecodeStep, canvas_length, check_supported, compiled_step, draw_noise, prefill
from .config import DecodeConfig
from .layout import build_layout, gather_span
from .levenshtein import DEL, INS, edit_probs, lev_log, levenshtein_block_step, shift_trace
from .sampling import candidates
from .steps import block_done, block_step, first_eos, mbe_edit_set, penalty_targets


@dataclass
class GenerationOutput:
    """One decoded sequence.

    token_ids: generated tokens, at most max_new_tokens, cut after the first EOS (EOS kept).
    trace: for each token of token_ids, the index (0-based, counted per sequence) of the forward whose
        step last wrote it. num_forwards counts every forward the sequence took part in (block steps and
        MBE passes; the prompt's cache prefill and block commits ride along and are not extra forwards).
    num_edits: tokens rewritten after being visible (T2T edits plus MBE edits); num_mbe_edits: the MBE part.
    edit_log: every such rewrite in order, as (offset from the prompt's end, old token, new token) (empty
        with `compiled_step`, which keeps counts only): what `rollout.edits.edit_counts` scores. Levenshtein
        operations are logged with new = the DELETE or INSERT id (offsets before that round's shift).
    lev_drafts: for each block in which a Levenshtein operation ran, (offset of the block's start from the
        prompt's end, possibly negative; the block's K tokens as the forward that first chose one saw them):
        the pre-edit drafts from which L-EBPO recovers the edit labels (`ebpo.core.lev_likelihood`).
    num_deletes / num_inserts: Levenshtein operations applied (`DecodeConfig.tau_delete` / `tau_insert`; they
        count in num_edits too). A token's trace follows it when a shift moves it.
    tail_ids: the rest of the canvas's block that holds the last token of token_ids (what the decoder wrote
        after the first EOS, or past max_new_tokens): the RL learner scores it with the response, so that
        it sees the canvas that was sampled, block for block (docs/ebpo.md).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    num_forwards: int
    tpf: float
    num_edits: int
    num_mbe_edits: int
    trace: list[int]
    finished_by_eos: bool
    tail_ids: list[int] = field(default_factory=list)
    edit_log: list[tuple[int, int, int]] = field(default_factory=list)
    num_deletes: int = 0
    num_inserts: int = 0
    lev_drafts: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass
class StepEvent:
    """What one forward did to one sequence (for `on_step` callbacks such as the `--show` view)."""

    seq: int  # index of the sequence in the prompts list
    forward: int  # the sequence's forward index (0-based)
    kind: str  # "block" (draft-and-edit step) or "mbe" (Multi-Block Editing pass)
    block: int  # active block index (for "mbe": the block that just ended)
    prompt_len: int
    canvas: list[int]  # the whole canvas after the step
    filled: list[int] = field(default_factory=list)  # absolute positions filled (M2T)
    edited: list[int] = field(default_factory=list)  # absolute positions rewritten (T2T / MBE)
    block_done: bool = False
    finished: bool = False
    deleted: list[int] = field(default_factory=list)  # absolute positions removed by DELETE (before the shift)
    inserted: list[int] = field(default_factory=list)  # absolute positions that got a [MASK] before them (INSERT)


@dataclass
class _Seq:
    """Host-side state of one sequence."""

    prompt_len: int
    num_blocks: int
    block: int  # active block index
    first_block: int
    forwards: int = 0
    edits: int = 0
    mbe_edits: int = 0
    finished: bool = False
    eos: bool = False
    mbe_start: int | None = None  # first block of the MBE window while MBE passes run, else None
    mbe_passes: int = 0
    mbe_first_changed: int | None = None
    edit_log: list = field(default_factory=list)  # (position, old, new) of every rewrite
    deletes: int = 0
    inserts: int = 0
    lev_drafts: dict = field(default_factory=dict)  # block -> its tokens before its first Levenshtein operation


def _eos_ids(config) -> set[int]:
    eos = config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _unpad_rows(prompts, attention_mask: torch.Tensor | None):
    """A (B, L) tensor batch (optionally with its (B, L) attention mask) as a list of per-row id lists;
    anything else passes through unchanged. Padding may sit on either side: only masked-in ids are kept."""
    if not isinstance(prompts, torch.Tensor):
        if attention_mask is not None:
            raise ValueError("generate: attention_mask is only accepted with a 2-D tensor of prompts")
        return prompts
    if prompts.dim() != 2:
        raise ValueError(f"generate: a tensor of prompts must be 2-D (batch, length), got shape {tuple(prompts.shape)}")
    if attention_mask is None:
        return [row.tolist() for row in prompts]
    if attention_mask.shape != prompts.shape:
        raise ValueError(f"generate: attention_mask has shape {tuple(attention_mask.shape)}, prompts "
                         f"{tuple(prompts.shape)}; they must match")
    keep = attention_mask.bool().cpu()
    return [row[k].tolist() for row, k in zip(prompts.cpu(), keep)]


def _encode_prompts(prompts, tokenizer, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        raise ValueError("generate: `prompts` must be a list of prompts (token-id lists or strings), not one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"generate: prompts[{i}] is text; pass tokenizer= to encode it")
            p = tokenizer(p, add_special_tokens=False)["input_ids"]
        p = [int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)]
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"generate: prompts[{i}] holds token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(p)
    if not out:
        raise ValueError("generate: `prompts` is empty")
    return out


def _make_generators(n, seeds, generators, temperature, device):
    if generators is not None:
        if len(generators) != n:
            raise ValueError(f"generate: generators needs one per prompt ({n}), got {len(generators)}")
        return list(generators)
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"generate: seeds needs one per prompt ({n}), got {len(seeds)}")
    if temperature == 0:
        return None
    if seeds is None:  # fresh, non-reproducible seeds; never touches the global RNG
        seeds = [torch.Generator().seed() for _ in range(n)]
    gdev = device if device.type == "cuda" else "cpu"
    return [torch.Generator(device=gdev).manual_seed(int(s)) for s in seeds]


@torch.no_grad()
def generate(model, prompts, config: DecodeConfig | None = None, *, tokenizer=None, seeds: list[int] | None = None,
             generators: list[torch.Generator] | None = None, progress: bool = False,
             on_step: Callable[[StepEvent], None] | None = None,
             attention_mask: torch.Tensor | None = None) -> list[GenerationOutput]:
    """Decode every prompt with draft-and-edit decoding; returns one `GenerationOutput` per prompt.

    model: an `LLaDA2MoeModelLM` (any module with the same forward signature and `config`).
    prompts: list of token-id lists (or strings, with `tokenizer`), any lengths (>= 0 tokens); or a 2-D
        (B, L) long tensor of token ids, each row one prompt, as a tokenizer returns it.
    attention_mask: only with a tensor `prompts`: (B, L), 1/True on the prompt's tokens, 0/False on padding
        (left or right, e.g. `tokenizer(texts, padding=True, return_tensors="pt")`); padding is dropped.
        Without it every position of a row is part of its prompt.
    config: a `DecodeConfig` (default: the `quality` preset).
    seeds / generators: one per prompt, for sampling (temperature > 0). A sequence's draws come only from
        its own generator, so its output does not depend on what else is in the batch.
    on_step: called with a `StepEvent` for every sequence after every forward.
    """
    cfg = config or DecodeConfig.preset("quality")
    mcfg = model.config
    K = cfg.block_size or mcfg.block_size
    mask_id, eos_ids = int(mcfg.mask_token_id), _eos_ids(mcfg)
    M = cfg.max_new_tokens
    ids = _encode_prompts(_unpad_rows(prompts, attention_mask), tokenizer, mcfg.vocab_size)
    n = len(ids)
    param = next(model.parameters())
    dev = param.device
    gens = _make_generators(n, seeds, generators, cfg.temperature, dev)
    if cfg.compiled_step:
        check_supported(cfg, on_step)
        return _generate_compiled(model, ids, cfg, gens, K, mask_id, eos_ids, tokenizer, progress)

    seqs, canvases = [], []
    for p in ids:
        P = len(p)
        T = -(-(P + M) // K) * K
        seqs.append(_Seq(prompt_len=P, num_blocks=T // K, block=P // K, first_block=P // K))
        canvases.append(p + [mask_id] * (T - P))
    T_max = max(len(c) for c in canvases)
    canvas = torch.full((n, T_max), mask_id, dtype=torch.long, device=dev)
    for r, c in enumerate(canvases):
        canvas[r, : len(c)] = torch.tensor(c, dtype=torch.long, device=dev)
    trace = torch.full((n, T_max), -1, dtype=torch.long, device=dev)
    post_steps = torch.zeros(n, dtype=torch.long, device=dev)
    block_iters = torch.zeros(n, dtype=torch.long, device=dev)
    cache = BlockKVCache.for_model(mcfg, n, T_max, dtype=param.dtype, device=dev) if cfg.use_cache else None
    block_cap = K + cfg.max_post_steps + 1
    lev = cfg.levenshtein
    if lev and getattr(mcfg, "delete_token_id", None) is None:
        raise ValueError("DecodeConfig.tau_delete / tau_insert: the model's config has no delete_token_id / "
                         "insert_token_id; Levenshtein editing needs a model trained with them")
    lev_ids = (int(mcfg.delete_token_id), int(mcfg.insert_token_id)) if lev else None
    total_blocks = sum(s.num_blocks - s.first_block for s in seqs)

    def finish_block(r: int) -> None:
        s = seqs[r]
        end = min(s.prompt_len + M, (s.block + 1) * K)
        gen = canvas[r, s.prompt_len:end].tolist()
        s.eos = first_eos(gen, eos_ids) is not None
        if (cfg.stop_at_eos and s.eos) or s.block + 1 >= s.num_blocks:
            s.finished = True
        else:
            s.block += 1
            post_steps[r] = 0
            block_iters[r] = 0

    while True:
        rows = [r for r in range(n) if not seqs[r].finished]
        if not rows:
            break
        # --- plan each row's slice: [uncommitted blocks ; active block] or an MBE window
        q_start, q_end, clamp, t_start, t_len = [], [], [], [], []
        for r in rows:
            s = seqs[r]
            if s.mbe_start is not None:
                lo, hi = s.mbe_start * K, (s.block + 1) * K
                q_start.append(lo if cache is not None else 0)
                clamp.append(s.mbe_start)
            else:
                lo, hi = s.block * K, (s.block + 1) * K
                q_start.append(cache.lengths[r] if cache is not None else 0)
                clamp.append(None)
            q_end.append(hi)
            t_start.append(lo)
            t_len.append(hi - lo)
        S = max(cache.lengths[r] for r in rows) if cache is not None else 0
        lay = build_layout(canvas[rows], q_start, q_end, K, clamp, S, mask_id)
        out = model(lay.input_ids, attention_mask=lay.keep, position_ids=lay.position_ids,
                    cache=cache, cache_rows=rows if cache is not None else None, return_logits=False)
        hidden = out.last_hidden_state

        # --- candidates, per group of equal target length (a row's noise draws depend only on its own span)
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for length in sorted(set(t_len)):
            members = [i for i, tl in enumerate(t_len) if tl == length]
            h = gather_span(hidden[members], [t_start[i] - q_start[i] for i in members], length)
            logits = model.lm_head(h).float()
            # design choice: a written token is never <|mask|> (a trained model gives it ~0 probability;
            # an untrained one would otherwise "fill" a mask with a mask and stall the block)
            logits[..., mask_id] = float("-inf")
            eprob = None
            if lev:  # price DELETE / INSERT, then keep them out of the tokens a step may write
                eprob = edit_probs(logits, *lev_ids)
                logits[..., list(lev_ids)] = float("-inf")
            pos = torch.tensor([t_start[i] for i in members], device=dev)[:, None] + torch.arange(length, device=dev)
            member_rows = torch.tensor([rows[i] for i in members], device=dev)
            suppress = None
            if cfg.repetition_penalty:
                prev = canvas[member_rows[:, None], (pos - 1).clamp(min=0)].masked_fill(pos == 0, mask_id)
                suppress = penalty_targets(prev, mask_id)
            g = [gens[rows[i]] for i in members] if gens is not None else None
            tok, prob = candidates(logits, cfg.temperature, cfg.top_k, cfg.top_p, g, suppress, cfg.repetition_penalty)
            for j, i in enumerate(members):
                results[i] = (tok[j], prob[j], None if eprob is None else eprob[j])

        commit = [0] * len(rows)
        block_idx = [i for i, r in enumerate(rows) if seqs[r].mbe_start is None]
        mbe_idx = [i for i, r in enumerate(rows) if seqs[r].mbe_start is not None]
        events: list[StepEvent] = []

        # --- draft-and-edit step for rows decoding their active block
        if block_idx:
            brows = torch.tensor([rows[i] for i in block_idx], device=dev)
            pos = torch.tensor([t_start[i] for i in block_idx], device=dev)[:, None] + torch.arange(K, device=dev)
            cur = canvas[brows[:, None], pos]
            protected = pos < torch.tensor([seqs[rows[i]].prompt_len for i in block_idx], device=dev)[:, None]
            tok = torch.stack([results[i][0] for i in block_idx])
            prob = torch.stack([results[i][1] for i in block_idx])
            if lev:
                lstep = levenshtein_block_step(tok, prob, torch.stack([results[i][2] for i in block_idx]), cur,
                                               protected, mask_id, cfg)
                res = lstep.result
            else:
                res = block_step(tok, prob, cur, protected, mask_id, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
            block_iters[brows] += 1
            done, post_steps[brows] = block_done(res, post_steps[brows], block_iters[brows], cfg.max_post_steps,
                                                 block_cap, cfg.editing, prob, cfg.early_commit)
            canvas[brows[:, None], pos] = res.new
            written = res.m2t | res.t2t
            fwd = torch.tensor([seqs[rows[i]].forwards for i in block_idx], device=dev)[:, None]
            if lev:  # tokens keep their trace as they shift
                trace[brows[:, None], pos] = shift_trace(trace[brows[:, None], pos], lstep, fwd)
            else:
                trace[brows[:, None], pos] = torch.where(written, fwd, trace[brows[:, None], pos])
            n_edit, any_write, done_l = res.t2t.sum(-1).tolist(), written.any(-1).tolist(), done.tolist()
            for j, i in enumerate(block_idx):
                r, s = rows[i], seqs[rows[i]]
                s.edits += n_edit[j]
                if lev and n_edit[j]:
                    s.edit_log += lev_log(lstep, j, pos[j], cur[j], s.prompt_len, *lev_ids)
                    s.deletes += int((lstep.ops[j] == DEL).sum())
                    s.inserts += int((lstep.ops[j] == INS).sum())
                    if ((lstep.ops[j] == DEL) | (lstep.ops[j] == INS)).any():
                        s.lev_drafts.setdefault(s.block, cur[j].tolist())
                elif n_edit[j]:
                    e = res.t2t[j]
                    s.edit_log += zip((pos[j][e] - s.prompt_len).tolist(), cur[j][e].tolist(), res.new[j][e].tolist())
                # commit the blocks before the active one; the active block too when it ended with a step
                # that wrote nothing (its keys/values were then computed from its final tokens)
                commit[i] = t_start[i] - q_start[i] + (K if done_l[j] and not any_write[j] else 0)
                if on_step is not None:
                    ev = StepEvent(r, s.forwards, "block", s.block, s.prompt_len, [], pos[j][res.m2t[j]].tolist(),
                                   pos[j][res.t2t[j]].tolist(), done_l[j])
                    if lev:
                        ev.filled, ev.edited = pos[j][lstep.filled[j]].tolist(), pos[j][lstep.rewritten[j]].tolist()
                        ev.deleted = pos[j][lstep.ops[j] == DEL].tolist()
                        ev.inserted = pos[j][lstep.ops[j] == INS].tolist()
                    events.append(ev)
                s.forwards += 1
                if done_l[j]:
                    if cfg.mbe_window > 0 and s.block > s.first_block:
                        s.mbe_start = max(s.first_block, s.block - cfg.mbe_window)
                        s.mbe_passes, s.mbe_first_changed = 0, None
                    else:
                        finish_block(r)

        # --- Multi-Block Editing pass for rows whose block just ended
        for i in mbe_idx:
            r, s = rows[i], seqs[rows[i]]
            lo = t_start[i]
            pos = torch.arange(lo, lo + t_len[i], device=dev)
            cur = canvas[r, pos]
            tok, prob, _ = results[i]
            change = mbe_edit_set(tok, prob, cur, pos >= s.prompt_len, cfg.mbe_tau)
            canvas[r, pos] = torch.where(change, tok, cur)
            trace[r, pos] = torch.where(change, s.forwards, trace[r, pos])
            changed = pos[change]
            n_changed = int(changed.numel())
            if n_changed:
                s.edit_log += zip((changed - s.prompt_len).tolist(), cur[change].tolist(), tok[change].tolist())
            s.mbe_edits += n_changed
            s.edits += n_changed
            if n_changed:
                first = int(changed.min()) // K
                s.mbe_first_changed = first if s.mbe_first_changed is None else min(first, s.mbe_first_changed)
            if on_step is not None:
                events.append(StepEvent(r, s.forwards, "mbe", s.block, s.prompt_len, [], [], changed.tolist(), True))
            s.forwards += 1
            s.mbe_passes += 1
            if n_changed == 0 or s.mbe_passes >= cfg.mbe_max_passes:
                if cache is not None and s.mbe_first_changed is not None:
                    # the edit invalidates the cached keys/values from the earliest edited block on
                    keep_len = min(cache.lengths[r], s.mbe_first_changed * K)
                    if keep_len < cache.lengths[r]:
                        cache.truncate([r], [keep_len])
                s.mbe_start = None
                finish_block(r)

        if cache is not None:
            cache.commit(commit)  # MBE rows commit 0: their window keys used a non-block-causal mask
        for ev in events:
            ev.canvas = canvas[ev.seq, : seqs[ev.seq].num_blocks * K].tolist()
            ev.finished = seqs[ev.seq].finished
            on_step(ev)
        if progress:
            done_blocks = sum((s.num_blocks if s.finished else s.block) - s.first_block for s in seqs)
            print(f"\rdecode: {done_blocks}/{total_blocks} blocks, {len(rows)} active sequences",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return [_output(ids[r], seqs[r], canvas[r], trace[r], M, eos_ids, tokenizer, K) for r in range(n)]


def _generate_compiled(model, ids, cfg, gens, K, mask_id, eos_ids, tokenizer, progress) -> list[GenerationOutput]:
    """`generate` with `compiled_step=True`: the fixed-shape step of `rollout.compiled`, compiled once, run
    until every row is finished; one host synchronisation per iteration (the termination check)."""
    M, n = cfg.max_new_tokens, len(ids)
    param = next(model.parameters())
    dev = param.device
    lens = [len(p) for p in ids]
    T = canvas_length(lens, M, K)
    canvas = torch.full((n, T), mask_id, dtype=torch.long, device=dev)
    for r, p in enumerate(ids):
        canvas[r, : len(p)] = torch.tensor(p, dtype=torch.long, device=dev)
    prompt_len = torch.tensor(lens, device=dev)
    num_blocks = torch.tensor([-(-(P + M) // K) for P in lens], device=dev)
    block = prompt_len // K
    first_block = block.clone()
    trace = torch.full((n, T), -1, dtype=torch.long, device=dev)
    post_steps, block_iters, forwards, edits = (torch.zeros(n, dtype=torch.long, device=dev) for _ in range(4))
    finished = torch.zeros(n, dtype=torch.bool, device=dev)
    cache = StaticKVCache.for_model(model.config, n, T + K, dtype=param.dtype, device=dev)  # + K: spare tail
    prefill(model, canvas, lens, K, cache)
    step = compiled_step(StaticDecodeStep(model, cfg, K, T, mask_id, eos_ids, cache))
    V = model.config.vocab_size
    live = [True] * n
    total = int((num_blocks - first_block).sum())
    while True:
        noise = draw_noise(gens, live, (K, V), dev) if cfg.temperature > 0 else torch.zeros(1, 1, 1, device=dev)
        step(canvas, trace, block, post_steps, block_iters, forwards, edits, finished, prompt_len, num_blocks, noise)
        live = (~finished).tolist()  # the one host synchronisation of the iteration
        if progress:
            done_blocks = int(torch.where(finished, num_blocks, block).sum() - first_block.sum())
            print(f"\rdecode: {done_blocks}/{total} blocks, {sum(live)} active sequences", end="", file=sys.stderr,
                  flush=True)
        if not any(live):
            break
    if progress:
        print(file=sys.stderr)
    fw, ed = forwards.tolist(), edits.tolist()
    seqs = [_Seq(prompt_len=P, num_blocks=0, block=0, first_block=0, forwards=fw[r], edits=ed[r])
            for r, P in enumerate(lens)]
    return [_output(ids[r], seqs[r], canvas[r], trace[r], M, eos_ids, tokenizer, K) for r in range(n)]


def _output(prompt: list[int], s: _Seq, canvas_row: torch.Tensor, trace_row: torch.Tensor, M: int,
            eos_ids: set[int], tokenizer, block_size: int = 0) -> GenerationOutput:
    P = s.prompt_len
    toks = canvas_row[P:P + M].tolist()
    tr = trace_row[P:P + M].tolist()
    cut = first_eos(toks, eos_ids)
    if cut is not None:
        toks, tr = toks[: cut + 1], tr[: cut + 1]
    end = P + len(toks)
    tail = canvas_row[end: -(-end // block_size) * block_size].tolist() if block_size else []
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(toks, skip_special_tokens=True)
    return GenerationOutput(prompt_ids=prompt, token_ids=toks, text=text, num_forwards=s.forwards,
                            tpf=len(toks) / max(s.forwards, 1), num_edits=s.edits, num_mbe_edits=s.mbe_edits,
                            trace=tr, finished_by_eos=cut is not None, tail_ids=tail, edit_log=list(s.edit_log),
                            num_deletes=s.deletes, num_inserts=s.inserts,
                            lev_drafts=[(b * block_size - P, d) for b, d in sorted(s.lev_drafts.items())])
