"""`ParallelRunner`: one rank of a tensor- / expert-parallel rollout engine, behind the runner seam
(`rollout.runner`).

Every rank of the TP x EP group runs its own `Engine` over the same prompts, settings and seeds (each rank holds its
own copy of every sequence's generator, in the same state). The engine's scheduling is a function of the tokens
and probabilities only, and those are the same on every rank: hidden states are replicated after each layer, and
the candidates come out of one all-gather (`ebpo.model.parallel.sampling`) whose result every rank computes from the
same gathered values. So every rank admits the same sequences into the same slots and makes the same model calls
in the same order, which the model's collectives need. Nothing here communicates besides the model.

What differs from `EagerRunner`:
  - the KV cache is the model's (`ParallelLLaDA2MoeLM.new_cache`): every layer, this rank's KV heads only;
  - candidates come from the vocabulary slices (`model.candidates`, `model.token_probs`): no row of logits is ever
    gathered. [MASK] (and, for Levenshtein rows, DELETE / INSERT) are banned before the draw, as in one process.
    Greedy picks the single-process argmax; a sampled row draws the Gumbel noise of the whole vocabulary from its
    own generator on every rank, so its tokens equal the single-process torch sampler's and its generator
    advances the same (docs/parallel.md, "What is exact").
The slots, the canvas, the decisions (`rollout.block_apply`) and shared prompt prefixes are `EagerRunner`'s.
The compiled step is not available in parallel (the expert all-to-all syncs with the host once per MoE layer).
"""
from __future__ import annotations

import torch

from .layout import gather_span
from .runner import EagerRunner
from .steps import penalty_targets


class ParallelRunner(EagerRunner):
    """The eager runner on one rank of a parallel model (module docstring). Arguments as `EagerRunner`'s; `model`
    is this rank's `ebpo.model.parallel.ParallelLLaDA2MoeLM`."""

    def __init__(self, model, cfg, *, max_batch: int, canvas_len: int, K: int, mask_id: int, model_lev_ids,
                 share_prefix: bool = True):
        if cfg.compiled_step:
            raise ValueError("DecodeConfig.compiled_step: the compiled step does not run a tensor- / expert-parallel "
                             "model (its expert all-to-all syncs with the host); use compiled_step=False")
        super().__init__(model, cfg, max_batch=max_batch, canvas_len=canvas_len, K=K, mask_id=mask_id,
                         model_lev_ids=model_lev_ids, share_prefix=share_prefix, use_cache=False)
        if cfg.use_cache:
            dtype = next(model.model.norm.parameters()).dtype  # FP8 layers hold other dtypes; the norms do not
            self.cache = model.new_cache(self.B, self.T, dtype=dtype, device=self.device)
            self.share_prefix = share_prefix

    def candidates(self, hidden, slots: list[int], plan, ready: list, cfgs: list, levs: list) -> list[tuple]:
        """Per ready row, (tok (t_len,), prob (t_len,), eprob (t_len, 2) or None), from the vocabulary slices.
        Rows are grouped as `rollout.forward.row_candidates` groups them (target length, sampling settings,
        edit ids): the same groups, in the same order, on every rank."""
        n = len(ready)
        groups: dict = {}
        for i in range(n):
            c = cfgs[i]
            key = (plan.t_len[i], c.temperature, c.top_k, c.top_p, c.repetition_penalty, levs[i])
            groups.setdefault(key, []).append(i)
        results: list[tuple | None] = [None] * n
        for (length, *_), members in sorted(groups.items(), key=lambda kv: kv[1][0]):
            self._group(hidden, slots, plan, ready, cfgs[members[0]], levs[members[0]], members, length, results)
        return results

    def _group(self, hidden, slots, plan, ready, cfg, lev_ids, members, length, results) -> None:
        """Candidates of the rows `members` (one target length, one sampling setting) into `results`."""
        dev = hidden.device
        h = gather_span(hidden[members], [plan.t_start[i] - plan.q_start[i] for i in members], length)
        banned = [self.mask_id]  # a written token is never [MASK] (rollout.forward)
        eprob = None
        if lev_ids is not None:
            eprob = self.model.token_probs(h, list(lev_ids), banned=banned)  # priced before they are banned
            banned = banned + list(lev_ids)
        suppress = None
        if cfg.repetition_penalty:
            pos = torch.tensor([plan.t_start[i] for i in members], device=dev)[:, None] + torch.arange(length,
                                                                                                      device=dev)
            rows = torch.tensor([slots[i] for i in members], device=dev)
            prev = self.slots.canvas[rows[:, None], (pos - 1).clamp(min=0)].masked_fill(pos == 0, self.mask_id)
            suppress = penalty_targets(prev, self.mask_id)
        gens = [ready[i].generator for i in members] if cfg.temperature > 0 else None
        tok, prob = self.model.candidates(h, cfg.temperature, cfg.top_k, cfg.top_p, gens, suppress,
                                          cfg.repetition_penalty, banned=banned)
        for j, i in enumerate(members):
            results[i] = (tok[j], prob[j], None if eprob is None else eprob[j])
