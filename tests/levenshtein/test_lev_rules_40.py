"""Levenshtein rules that no happy-path test pins (issue 40).

* L-EBPO's draws (`learner_draws`) pad a partial last block with [MASK] for the alignment and cut it back: for
  every block size and every remainder L mod K, each block's labels are those of a plain per-block reading of
  the rules with the partial block padded by [MASK] (tests/support/lev_reference.py);
* the Levenshtein SFT round (`lev_round`) weighs each editable position as its docstring says: `keep_weight`
  where the label is the draft's own token (keep), `edit_weight` where it is DELETE or INSERT, 1 elsewhere,
  summed and divided by the number of editable positions; nothing outside the editable positions counts.
"""
import random
import re
import types

import pytest
import torch

from tests.support import lev_reference as ref
from ebpo.core.lev_likelihood import learner_draws
from ebpo.core.levenshtein import lcs_labels
from ebpo.core.lev_objective import lev_round
from ebpo.core.likelihood import draw_noise
from ebpo.core.objectives import noisy_half_hidden

MASK, DEL, INS = 2, 105, 106


def _case(K, L, seed):
    rng = random.Random(seed)
    B = 3
    ids = torch.tensor([[rng.randint(5, 9) for _ in range(L)] for _ in range(B)])  # few tokens: many repeats
    resp = torch.zeros(B, L, dtype=torch.bool)
    prompt_lens = [rng.randint(0, L - 1) for _ in range(B)]
    for i, p in enumerate(prompt_lens):
        resp[i, p:] = True
    lev = []  # pre-edit drafts of some blocks (one past L is ignored: the partial last block's)
    for i, p in enumerate(prompt_lens):
        recs = []
        for b0 in range(0, L, K):
            if rng.random() < 0.6 and b0 + K > p:  # a block holding response tokens; its context stays as is
                recs.append((b0 - p, [int(ids[i, q]) if q < min(p, L) else rng.choice([MASK, 5, 6, 7, 8, 9])
                                      for q in range(b0, b0 + K)]))
        lev.append(recs)
    return ids, resp, prompt_lens, lev


def _plain_draws(noise, ids, resp, prompt_lens, lev, K):
    """Targets and scored-visible flags of every (draw, row, position), block by block in plain Python, the
    partial last block padded with [MASK] (draft and output alike) and cut back."""
    N, B, L = noise.masked.shape
    targets = torch.zeros(N, B, L, dtype=torch.long)
    edited = torch.zeros(N, B, L, dtype=torch.bool)
    for i in range(B):
        draft = ids[i].tolist()
        for start, toks in lev[i]:
            lo = prompt_lens[i] + start
            if 0 <= lo and lo + K <= L:
                draft[lo:lo + K] = toks
        for n in range(N):
            for b0 in range(0, L, K):
                hi = min(b0 + K, L)
                z = [MASK if noise.masked[n, i, p] else draft[p] for p in range(b0, hi)] + [MASK] * (b0 + K - hi)
                y = ids[i, b0:hi].tolist() + [MASK] * (b0 + K - hi)
                lab = ref.label_ids(z, y, MASK, DEL, INS)
                for p in range(b0, hi):
                    targets[n, i, p] = lab[p - b0]
                    edited[n, i, p] = bool(resp[i, p]) and not bool(noise.masked[n, i, p]) and lab[p - b0] != z[p - b0]
    return targets, edited


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_learner_draws_pad_every_remainder_as_a_plain_per_block_loop(K):
    cfg = types.SimpleNamespace(delete_token_id=DEL, insert_token_id=INS, mask_token_id=MASK)
    for r, seed in [(r, s) for r in range(K) for s in range(4)]:  # every remainder, 0 (whole blocks) included
        L = 2 * K + r
        ids, resp, prompt_lens, lev = _case(K, L, seed=100 * K + 10 * r + seed)
        noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(r))
        out = learner_draws(noise, ids, resp, prompt_lens, lev, cfg, weight=0.7)
        targets, edited = _plain_draws(noise, ids, resp, prompt_lens, lev, K)
        assert out.targets.shape == (3, 3, L) and torch.equal(out.masked, noise.masked)
        assert torch.equal(out.targets, targets), (K, r)
        assert torch.equal(out.substituted, edited), (K, r)
        assert torch.equal(out.weight, torch.where(edited, torch.full_like(noise.weight, 0.7), noise.weight))
        assert out.noisy_ids.shape == (3, 3, L)


def test_lev_round_weighs_keep_edit_and_other_positions_as_documented(small_model):
    model = small_model
    K = model.config.block_size
    rng = random.Random(4)
    B, L = 4, 4 * K
    clean = torch.tensor([[rng.randint(5, 9) for _ in range(L)] for _ in range(B)])
    draft = clean.clone()
    for b in range(B):  # duplicated, dropped, substituted and masked tokens
        for p in rng.sample(range(L), 6):
            draft[b, p] = rng.choice([MASK, 5, 6, 7, 8, 9, draft[b, max(p - 1, 0)].item()])
    editable = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        editable[b, rng.randint(0, K + 1):] = True
    labels = torch.tensor([[t for k in range(0, L, K)
                            for t in ref.label_ids(draft[b, k:k + K].tolist(), clean[b, k:k + K].tolist(), MASK, DEL, INS)]
                           for b in range(B)])
    with torch.no_grad():
        logp = model.lm_head(noisy_half_hidden(model, draft, clean, K)).float().log_softmax(-1)
    kinds = set()
    for keep_weight, edit_weight in [(0.3, 2.0), (0.0, 1.0), (1.7, 0.25)]:
        with torch.no_grad():
            loss, _, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, keep_weight,
                                   edit_weight)
        total, n = 0.0, 0
        for b in range(B):
            for p in range(L):
                if not editable[b, p]:
                    continue
                n += 1
                lab = int(labels[b, p])
                if lab in (DEL, INS):
                    w, kind = edit_weight, "edit"
                elif lab == int(draft[b, p]):
                    w, kind = keep_weight, "keep"
                else:
                    w, kind = 1.0, "write"
                kinds.add(kind)
                total += -w * float(logp[b, p, lab])
        # fp32 log-softmax of |logits| of a few units, summed over < 100 terms: 1e-5 relative
        assert float(loss) == pytest.approx(total / n, rel=1e-5, abs=1e-6), (keep_weight, edit_weight)
    assert kinds == {"edit", "keep", "write"}  # every kind of position was there to weigh


def test_lev_round_loss_ignores_non_editable_positions(small_model):
    model = small_model
    K = model.config.block_size
    clean = torch.arange(5, 5 + 3 * K).remainder(5).add(5)[None]
    draft = clean.clone()
    draft[0, 1], draft[0, K + 2] = MASK, 9
    editable = torch.zeros_like(clean, dtype=torch.bool)
    editable[0, K:] = True
    with torch.no_grad():
        a, _, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, 0.5)
        e = torch.zeros_like(editable)
        z, _, _ = lev_round(model, model.lm_head, draft, clean, e, K, MASK, DEL, INS, 0.5)
    assert torch.isfinite(a) and float(z) == 0.0


def test_lcs_labels_refuses_anything_but_two_equal_n_by_k_blocks():
    """lcs_labels takes draft and target of one shape (N, K): a different shape (both 2-D, or one row more) and
    a shape that is not 2-D are refused, naming both shapes."""
    bad = [((2, 4), (2, 5)), ((2, 4), (3, 4)), ((4,), (4,)), ((1, 2, 4), (1, 2, 4))]
    for ds, ts in bad:
        want = rf"^lcs_labels: draft and target must both be \(N, K\), got {re.escape(str(ds))} and {re.escape(str(ts))}$"
        with pytest.raises(ValueError, match=want):
            lcs_labels(torch.zeros(ds, dtype=torch.long), torch.zeros(ts, dtype=torch.long), MASK)
    ops, toks = lcs_labels(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), MASK)
    assert ops.shape == toks.shape == (2, 4)
