"""`generate`: draft-and-edit decoding of a list of prompts (LLaDA2.1 joint thresholds, LLaDA2.2 DELETE /
INSERT, Multi-Block Editing), through the continuous-batching engine of `rollout.engine`.

Each prompt becomes one sequence of the engine; at most `max_batch` (or `DecodeConfig.max_batch`) decode at
once and a finished sequence's slot takes the next prompt at the next forward. A sequence's tokens do not
depend on `max_batch` or on its neighbours. docs/decoding.md explains the algorithm and the block-end rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .block_apply import StepEvent
from .config import DecodeConfig
from .engine_holder import EngineHolder
from .steps import first_eos


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
             attention_mask: torch.Tensor | None = None, max_batch: int | None = None,
             max_new_tokens: list[int] | None = None, engines=None) -> list[GenerationOutput]:
    """Decode every prompt with draft-and-edit decoding; returns one `GenerationOutput` per prompt, in order.

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
    max_batch: most sequences decoding at once (default `config.max_batch`; 0 there = all prompts at once).
    max_new_tokens: one length per prompt instead of `config.max_new_tokens` for all (a server's per-request
        budget; the RL-like workload of `ebpo bench decode --rl-workload`).
    engines: an `EngineHolder` whose long-lived engine decodes the call (a rollout worker's); default a fresh one.
    """
    cfg = config or DecodeConfig.preset("quality")
    mcfg = model.config
    K = cfg.block_size or mcfg.block_size
    ids = _encode_prompts(_unpad_rows(prompts, attention_mask), tokenizer, mcfg.vocab_size)
    dev = next(model.parameters()).device
    gens = _make_generators(len(ids), seeds, generators, cfg.temperature, dev)
    if cfg.compiled_step:
        from .compiled import check_supported

        check_supported(cfg, on_step)
    limit = max_batch if max_batch is not None else cfg.max_batch
    lengths = list(max_new_tokens) if max_new_tokens is not None else [cfg.max_new_tokens] * len(ids)
    if len(lengths) != len(ids) or any(int(m) < 1 for m in lengths):
        raise ValueError(f"generate: max_new_tokens needs one length >= 1 per prompt ({len(ids)}), got {lengths}")
    T = max(-(-(len(p) + m) // K) * K for p, m in zip(ids, lengths))
    if cfg.compiled_step:
        from .compiled import canvas_length

        T = max(canvas_length([len(p)], m, K) for p, m in zip(ids, lengths))
    engine = (engines or EngineHolder(model)).get(cfg, canvas_len=T, max_batch=min(limit or len(ids), len(ids)),
                                                  on_step=on_step, progress=progress)
    seqs = [engine.submit(p, None if gens is None else gens[i], max_new_tokens=lengths[i], config=cfg)
            for i, p in enumerate(ids)]
    engine.run()
    engine.forget_finished()
    return [_output(s, engine.eos_ids, tokenizer, K) for s in seqs]


def _output(s, eos_ids: set[int], tokenizer, block_size: int) -> GenerationOutput:
    """The `GenerationOutput` of a finished single-turn engine `Sequence`."""
    P, M = s.prompt_len, s.max_new
    toks = s.canvas[P:P + M]
    tr = s.trace[P:P + M]
    cut = first_eos(toks, eos_ids)
    if cut is not None:
        toks, tr = toks[: cut + 1], tr[: cut + 1]
    end = P + len(toks)
    tail = s.canvas[end: -(-end // block_size) * block_size]
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(toks, skip_special_tokens=True)
    return GenerationOutput(prompt_ids=list(s.prompt), token_ids=toks, text=text, num_forwards=s.forwards,
                            tpf=len(toks) / max(s.forwards, 1), num_edits=s.edits, num_mbe_edits=s.mbe_edits,
                            trace=tr, finished_by_eos=cut is not None, tail_ids=tail, edit_log=list(s.edit_log),
                            num_deletes=s.deletes, num_inserts=s.inserts,
                            lev_drafts=[(b * block_size - P, d) for b, d in sorted(s.lev_drafts.items())])
