"""The next-round draft of Levenshtein SFT under the decoder's rules (issue 35; `lev_draft` section of a recipe).

`ebpo.core.lev_objective.levenshtein_loss` trains each later Levenshtein round on the draft its previous round
leads to. Without a `next_draft` it applies the model's argmax at every editable position: every position
rewritten, every DELETE / INSERT argmax applied, however unsure. The decoder does much less per forward, so
those drafts are states it never reaches. `decoder_next_draft` applies instead, to every block of the draft,
one block step of the decoder (`rollout.levenshtein.levenshtein_block_step`) with the recipe's thresholds:

* DELETE / INSERT where p(DELETE) > tau_delete / p(INSERT) > tau_insert (strict; the likelier of the two; the
  `max_lev_edits` most confident per block; never on a [MASK] followed by nothing but [MASK]s);
* M2T fills the [MASK]s whose candidate has probability > tau_mask (at least `num_to_transfer`, the most
  confident); T2T rewrites the visible tokens whose candidate differs with probability > tau_edit;
* a position that takes an operation is neither filled nor rewritten; prompt positions are never touched.

Candidates are greedy (the argmax, temperature 0, no repetition penalty), priced as the decoder prices them:
p(DELETE), p(INSERT) from the logits with [MASK] excluded, the candidate token and its probability with
[MASK], DELETE and INSERT excluded. No generator is drawn from. Every block is one active block: the
`[draft ; clean]` forward shows it the target's earlier blocks, as the decoder shows it the committed ones.
"""
from __future__ import annotations

import torch

from rollout.config import DecodeConfig
from rollout.levenshtein import edit_probs, levenshtein_block_step
from rollout.sampling import candidates


def greedy_candidates(logits: torch.Tensor, mask_id: int, delete_id: int, insert_id: int):
    """(tok (N,) long, prob (N,) fp32, eprob (N, 2) fp32) of logits (N, V), as the decoder's forward prices them:
    [MASK] excluded everywhere (a written token is never [MASK]), p(DELETE) / p(INSERT) read before the
    edit-control tokens are excluded from the candidates (a written token is never DELETE or INSERT)."""
    x = logits.float().clone()
    x[:, mask_id] = float("-inf")
    eprob = edit_probs(x, delete_id, insert_id)
    x[:, [delete_id, insert_id]] = float("-inf")
    tok, prob = candidates(x[None], 0.0)
    return tok[0], prob[0], eprob


def decoder_next_draft(cfg: DecodeConfig, mask_id: int, delete_id: int, insert_id: int):
    """The `next_draft` of `ebpo.core.lev_objective.levenshtein_loss` that applies `cfg`'s thresholds (module
    docstring): (draft (B, L) long, logits (N, V) of the editable positions, editable (B, L) bool, K) -> (B, L)."""

    def next_draft(draft: torch.Tensor, logits: torch.Tensor, editable: torch.Tensor, block_size: int) -> torch.Tensor:
        B, L = draft.shape
        tok_e, prob_e, eprob_e = greedy_candidates(logits, mask_id, delete_id, insert_id)
        # the step works on whole blocks; the prompt positions get placeholders (their own token, probability 0),
        # which the step never reads since they are protected
        tok = draft.clone()
        tok[editable] = tok_e
        prob = torch.zeros(B, L, dtype=torch.float32, device=draft.device)
        prob[editable] = prob_e
        eprob = torch.zeros(B, L, 2, dtype=torch.float32, device=draft.device)
        eprob[editable] = eprob_e
        K = block_size

        def blocks(t):
            return t.reshape(B * (L // K), K, *t.shape[2:])
        step = levenshtein_block_step(blocks(tok), blocks(prob), blocks(eprob), blocks(draft), blocks(~editable),
                                      mask_id, cfg)
        return step.result.new.reshape(B, L)

    return next_draft
