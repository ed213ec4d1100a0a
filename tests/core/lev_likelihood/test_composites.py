"""L-EBPO composites (ebpo.core.lev_likelihood): exact against a per-block reference loop, and EBPO bit for bit when no
rollout inserted or deleted anything (composites in every layout, and the learner's whole update)."""
import copy

import pytest
import torch

from ebpo.core.lev_likelihood import drafts_from_rollouts, learner_draws, levenshtein_draws
from ebpo.core.levenshtein import alignment
from ebpo.core.likelihood import all_composites, composite_logprobs_blockwise, draw_noise
from ebpo.rl.learner import EBPOLearner, LearnerConfig

EOS, MASK, DEL, INS, K = 1, 2, 105, 106, 4


def batch_ids():
    ids = torch.tensor([[5, 6, 7, 20, 21, 22, 23, 24, 25, EOS, EOS, EOS],
                        [8, 9, 10, 11, 12, 30, 31, 32, 33, 34, 35, 36],
                        [13, 14, 40, 41, 42, 43, 44, 45, 46, 47, EOS, EOS]])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    for i, p in enumerate([3, 5, 2]):
        resp[i, p:] = True
    return ids, resp


# pre-edit drafts of some blocks: a repeated token (the decoder deleted it), a dropped one (it inserted), a mask
LEV_DRAFTS = [[(1, [22, 22, 23, 24])], [(3, [33, 35, 36, MASK]), (-1, [12, 30, 30, 31])], []]


def _plain_labels(x, y):
    """The gap rules read literally (as in test_labels.py), on one block's anchors."""
    anchor = alignment(torch.tensor([x]), torch.tensor([y]), MASK)[0].tolist()
    labels, pi, pj = list(x), -1, -1
    for i, j in [(i, j) for i, j in enumerate(anchor) if j >= 0]:
        free, tgt = list(range(pi + 1, i)), list(range(pj + 1, j))
        for r, p in enumerate(free):
            labels[p] = y[tgt[r]] if r < len(tgt) else DEL
        labels[i] = INS if len(tgt) > len(free) else y[j]
        pi, pj = i, j
    for p in range(pi + 1, len(x)):
        labels[p] = DEL
    return labels


def plain_lev_composite(model, ids, resp, drafts, noise, n, weight):
    """Draw n of every row, one forward per (row, block) over [clean blocks < b ; noised draft block b], full
    logits; labels of each block from its own alignment; masked positions weighted 1/t, edited visible ones `weight`."""
    B, L = ids.shape
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        for b0 in range(0, L, K):
            m = noise.masked[n, i, b0:b0 + K]
            z = drafts[i, b0:b0 + K].clone()
            z[m] = MASK
            labels = _plain_labels(z.tolist(), ids[i, b0:b0 + K].tolist())
            score = [j for j in range(K) if resp[i, b0 + j] and (m[j] or labels[j] != int(z[j]))]
            if not score:
                continue
            logp = model(torch.cat([ids[i, :b0], z])[None]).logits[0, b0:].double().log_softmax(-1)
            for j in score:
                w = float(noise.weight[n, i, b0 + j]) if m[j] else weight
                out[i] += logp[j, labels[j]] * w
    return out


@pytest.mark.parametrize("layout", ["unpacked", "packed", "cached", "blockwise"])
def test_lev_composite_equals_per_block_reference_loop(small_model, layout):
    ids, resp = batch_ids()
    drafts = drafts_from_rollouts(ids, torch.tensor([3, 5, 2]), LEV_DRAFTS, K)
    assert not torch.equal(drafts, ids)
    noise = draw_noise(resp, K, 4, 0.1, 0.5, torch.Generator().manual_seed(4))
    lev = levenshtein_draws(noise, ids, resp, drafts, MASK, DEL, INS, weight=0.7)
    assert (lev.targets[lev.scored()] == DEL).any(), "a DELETE label was recovered from the repeated token"
    assert (lev.targets[lev.scored()] == INS).any(), "an INSERT label was recovered from the dropped token"
    with torch.no_grad():
        if layout == "blockwise":
            got = torch.stack([composite_logprobs_blockwise(small_model, ids, lev, n, MASK) for n in range(4)], 1)
        else:
            got = all_composites(small_model, ids, lev, MASK, packed=layout == "packed", cached=layout == "cached")
        for n in range(4):
            ref = plain_lev_composite(small_model, ids, resp, drafts, noise, n, 0.7)
            assert torch.allclose(got[:, n].double(), ref, rtol=1e-4, atol=1e-4), (n, got[:, n], ref)


def test_labels_are_recovered_per_draw():
    ids, resp = batch_ids()
    drafts = drafts_from_rollouts(ids, torch.tensor([3, 5, 2]), LEV_DRAFTS, K)
    noise = draw_noise(resp, K, 8, 0.1, 1.0, torch.Generator().manual_seed(5))
    lev = levenshtein_draws(noise, ids, resp, drafts, MASK, DEL, INS)
    per_draw = {tuple(lev.targets[n][lev.scored()[n]].tolist()) for n in range(8)}
    assert len(per_draw) > 1
    # a draw that masks the whole duplicated block labels it by filling: no DELETE there
    for n in range(8):
        blk = slice(4, 8)
        if noise.masked[n, 0, blk].all():
            assert not (lev.targets[n, 0, blk] == DEL).any()


@pytest.mark.parametrize("layout", ["unpacked", "packed", "cached"])
@pytest.mark.parametrize("form", ["bernoulli", "exact_elbo"])
def test_no_insert_or_delete_is_ebpo_bit_for_bit(small_model, layout, form):
    ids, resp = batch_ids()
    noise = draw_noise(resp, K, 3, 0.1, 1.0, torch.Generator().manual_seed(1), form)
    kw = dict(packed=layout == "packed", cached=layout == "cached", return_blocks=True)
    with torch.no_grad():
        a = all_composites(small_model, ids, noise, MASK, **kw)
        for drafts in (None, ids.clone()):
            lev = levenshtein_draws(noise, ids, resp, drafts, MASK, DEL, INS)
            b = all_composites(small_model, ids, lev, MASK, **kw)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def learner_batch(lev_drafts=None):
    ids, resp = batch_ids()
    b = {"input_ids": ids[:, :10], "prompt_lens": torch.tensor([3, 5, 2]), "response_mask": resp[:, :10],
         "advantages": torch.tensor([1.0, -0.5, 0.3]), "group_ids": torch.tensor([0, 0, 1])}
    if lev_drafts is not None:
        b["lev_drafts"] = lev_drafts
    return b


def test_learner_without_edits_is_ebpo_bit_for_bit_and_with_edits_differs(small_model):
    small_model.config.delete_token_id, small_model.config.insert_token_id = DEL, INS
    cfg = dict(lr=1e-3, n_draws=2, mu=2, minibatch_size=2, seed=5)
    runs = {}
    for name, extra, batch in [("ebpo", {}, learner_batch()), ("lev", {"levenshtein": True}, learner_batch()),
                               ("lev_empty", {"levenshtein": True}, learner_batch([[], [], []])),
                               ("lev_edits", {"levenshtein": True}, learner_batch(LEV_DRAFTS))]:
        learner = EBPOLearner(copy.deepcopy(small_model), LearnerConfig(**cfg, **extra))
        m = learner.update(batch)
        runs[name] = ({k: v for k, v in m.items() if not k.startswith(("timing_s/", "likelihood/lev_"))},
                      {k: v.clone() for k, v in learner.model.state_dict().items()})
    m0, w0 = runs["ebpo"]
    for name in ("lev", "lev_empty"):
        m1, w1 = runs[name]
        assert m0 == m1 and all(torch.equal(w0[k], w1[k]) for k in w0), name
    m2, w2 = runs["lev_edits"]
    assert not all(torch.equal(w0[k], w2[k]) for k in w0)


def test_learner_draws_pad_partial_blocks():
    ids, resp = batch_ids()
    ids, resp = ids[:, :10], resp[:, :10]
    cfg = type("C", (), {"delete_token_id": DEL, "insert_token_id": INS, "mask_token_id": MASK})()
    noise = draw_noise(resp, K, 2, 0.1, 1.0, torch.Generator().manual_seed(2))
    lev = learner_draws(noise, ids, resp, [3, 5, 2], LEV_DRAFTS, cfg, 1.0)
    assert lev.targets.shape == noise.masked.shape and torch.equal(lev.masked, noise.masked)
    with pytest.raises(ValueError, match="t2t_weight"):
        LearnerConfig(levenshtein=True, t2t_weight=1.0).validate()
