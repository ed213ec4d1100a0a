"""Editing-aware composite (M2T masks + T2T substitutions) against references written plainly here.

* every layout (unpacked, packed, KV-cached, one forward per block) equals a per-block loop that builds
  each noisy block by hand and reads full logits;
* no substitution (and `t2t_weight = 0` in the learner) is the mask-only composite bit for bit, and the
  learner's M2T draws and minibatch order are not perturbed by the T2T draws;
* the estimator's expectation equals an enumeration of every mask subset, substitution subset and
  substitute token on a tiny case;
* drafts are the model's own samples, never the mask token, and a draft equal to the clean token is no
  substitution.
"""
import copy
import itertools
import math

import pytest
import torch

from ebpo.core.editing import add_substitutions, choose_positions, draft_substitutes
from ebpo.core.likelihood import NoiseDraws, all_composites, composite_logprobs_blockwise, draw_noise
from ebpo.core.noise import substitution_ids
from ebpo.rl.learner import EBPOLearner, LearnerConfig

EOS, MASK, BOS = 1, 2, 0


def batch_ids():
    ids = torch.tensor([[5, 6, 7, 20, 21, 22, 23, 24, 25, EOS, EOS, EOS, EOS, EOS],
                        [8, 9, 10, 11, 12, 30, 31, 32, 33, 34, 35, 36, 37, EOS],
                        [13, 14, 40, 41, 42, 43, 44, 45, 46, 47, 48, EOS, EOS, EOS]])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, e) in enumerate([(3, 9), (5, 13), (2, 11)]):
        resp[i, p: e + 1] = True
    return ids, resp


def allowed(vocab=128):
    return substitution_ids(vocab, [MASK, BOS])


def plain_composite(model, ids, noise, n, K):
    """Draw n of every row, one forward per (row, block) over [clean blocks < b ; noisy block b], full logits:
    masked tokens weighted by the M2T weight, substituted ones by the T2T weight (both read from `weight`)."""
    B, L = ids.shape
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        for b0 in range(0, L, K):
            m = noise.masked[n, i, b0:b0 + K]
            s = noise.substituted[n, i, b0:b0 + K] if noise.substituted is not None else torch.zeros_like(m)
            if not (m | s).any():
                continue
            block = ids[i, b0:b0 + K].clone()
            block[s] = noise.sub_ids[n, i, b0:b0 + K][s]
            block[m] = MASK
            x = torch.cat([ids[i, :b0], block])[None]
            logp = model(x).logits[0, b0:].double().log_softmax(-1)
            for j in (m | s).nonzero().flatten().tolist():
                out[i] += logp[j, ids[i, b0 + j]] * float(noise.weight[n, i, b0 + j])
    return out


@pytest.mark.parametrize("form", ["bernoulli", "exact_elbo"])
@pytest.mark.parametrize("layout", ["unpacked", "packed", "cached", "blockwise"])
def test_editing_composite_equals_per_block_loop(small_model, form, layout):
    ids, resp = batch_ids()
    g = torch.Generator().manual_seed(3)
    nz = add_substitutions(draw_noise(resp, 4, 3, 0.1, 1.0, g, form), ids, resp, rate=0.4, weight=0.7,
                           source="uniform", allowed_ids=allowed(), generator=torch.Generator().manual_seed(9))
    assert nz.substituted.any() and not (nz.substituted & nz.masked).any()
    assert not (nz.substituted & ~resp[None]).any(), "only response tokens may be substituted"
    assert (nz.sub_ids[nz.substituted] != ids[None].expand_as(nz.sub_ids)[nz.substituted]).all()
    assert torch.equal(nz.weight[nz.substituted], torch.full_like(nz.weight[nz.substituted], 0.7 / 0.4))
    with torch.no_grad():
        if layout == "blockwise":
            got = torch.stack([composite_logprobs_blockwise(small_model, ids, nz, n, MASK) for n in range(3)], 1)
        else:
            got = all_composites(small_model, ids, nz, MASK, packed=layout == "packed", cached=layout == "cached")
        for n in range(3):
            ref = plain_composite(small_model, ids, nz, n, 4)
            assert torch.allclose(got[:, n].double(), ref, rtol=1e-4, atol=1e-4), (n, got[:, n], ref)


@pytest.mark.parametrize("layout", ["unpacked", "packed", "cached"])
def test_no_substitution_is_the_mask_only_composite_bit_for_bit(small_model, layout):
    ids, resp = batch_ids()
    nz = draw_noise(resp, 4, 3, 0.1, 1.0, torch.Generator().manual_seed(1), "exact_elbo")
    empty = NoiseDraws(nz.masked, nz.t, nz.weight, 4, torch.zeros_like(nz.masked), ids[None].expand(3, -1, -1))
    with torch.no_grad():
        a = all_composites(small_model, ids, nz, MASK, packed=layout == "packed", cached=layout == "cached",
                           return_blocks=True)
        b = all_composites(small_model, ids, empty, MASK, packed=layout == "packed", cached=layout == "cached",
                           return_blocks=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def learner_batch():
    ids, resp = batch_ids()
    return {"input_ids": ids, "prompt_lens": torch.tensor([3, 5, 2]), "response_mask": resp,
            "advantages": torch.tensor([1.0, -0.5, 0.3]), "group_ids": torch.tensor([0, 0, 1])}


def test_t2t_weight_zero_is_the_mask_only_learner_and_t2t_draws_leave_the_m2t_stream_alone(small_model, monkeypatch):
    cfg = dict(lr=1e-3, n_draws=2, mu=2, minibatch_size=2, seed=5, noise="exact_elbo")
    runs = {}
    seen = []
    import ebpo.rl.learner as learner_mod

    real = learner_mod.editing_draws

    def spy(noise, *a, **k):
        seen.append(noise.masked.clone())
        return real(noise, *a, **k)

    monkeypatch.setattr(learner_mod, "editing_draws", spy)
    for name, extra in [("default", {}), ("zero", {"t2t_weight": 0.0, "t2t_rate": 0.5}),
                        ("t2t", {"t2t_weight": 1.0, "t2t_rate": 0.5})]:
        learner = EBPOLearner(copy.deepcopy(small_model), LearnerConfig(**cfg, **extra))
        m = learner.update(learner_batch())
        runs[name] = (m, learner.generator.get_state(), {k: v.clone() for k, v in learner.model.state_dict().items()})
    assert len(seen) == 1, "the T2T module runs only when t2t_weight > 0"
    (m0, g0, w0), (m1, _, w1), (m2, g2, w2) = runs["default"], runs["zero"], runs["t2t"]
    assert m0 == {**m1, **{k: m0[k] for k in m0 if k.startswith("timing_s/")}}
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "t2t_weight 0 must be the mask-only update bit for bit"
    # the T2T draws come from a generator of their own: the learner's stream is where the mask-only one is
    assert torch.equal(g0, g2)
    ref = draw_noise(learner_batch()["response_mask"], 4, 2, 0.1, 1.0, torch.Generator().manual_seed(5), "exact_elbo")
    assert torch.equal(seen[0], ref.masked), "the editing-aware learner must see the mask-only M2T draws"
    assert m2["likelihood/substituted_per_seq"] > 0 and m0["likelihood/substituted_per_seq"] == 0
    assert not all(torch.equal(w0[k], w2[k]) for k in w0), "the T2T terms must change the update"


def test_editing_learner_first_old_pass_gives_log_ratio_exactly_zero(small_model):
    cfg = LearnerConfig(lr=1e-30, n_draws=3, mu=2, seed=2, t2t_weight=1.0, t2t_rate=0.3, t2t_source="mixed")
    learner = EBPOLearner(copy.deepcopy(small_model), cfg)
    m = learner.update(learner_batch())
    assert m["actor/log_ratio_mean"] == 0.0 and m["actor/log_ratio_max"] == 0.0, "old and current share the draws"


def enumerated_expectation(model, ids_row, b0, pos, K, rate, lam, allowed_ids):
    """E over k ~ U{1..m}, |M| = k uniform, each visible position substituted w.p. rate by a token uniform over
    allowed_ids minus the clean one, of (m/k) sum_M log p + (lam/rate) sum_S log p. Every case enumerated."""
    m = len(pos)
    total = 0.0
    for k in range(1, m + 1):
        for M in itertools.combinations(pos, k):
            vis = [p for p in pos if p not in M]
            p_M = (1 / m) / math.comb(m, k)
            for r in range(len(vis) + 1):
                for S in itertools.combinations(vis, r):
                    p_S = rate ** r * (1 - rate) ** (len(vis) - r)
                    choices = [[int(a) for a in allowed_ids if int(a) != int(ids_row[p])] for p in S]
                    for toks in itertools.product(*choices):
                        p_T = 1.0 / math.prod(len(c) for c in choices) if choices else 1.0
                        block = ids_row[b0:b0 + K].clone()
                        for p, tk in zip(S, toks):
                            block[p - b0] = tk
                        for p in M:
                            block[p - b0] = MASK
                        with torch.no_grad():
                            logp = model(torch.cat([ids_row[:b0], block])[None]).logits[0, b0:].double().log_softmax(-1)
                        v = (m / k) * sum(float(logp[p - b0, ids_row[p]]) for p in M)
                        v += (lam / rate) * sum(float(logp[p - b0, ids_row[p]]) for p in S)
                        total += p_M * p_S * p_T * v
    return total


def test_editing_estimator_expectation_by_enumeration(small_model):
    """Tiny case: blocks of 4 holding 1 and 3 response tokens, 3 allowed substitutes."""
    K, N, R, rate, lam = 4, 2, 4000, 0.4, 0.7
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 43]])  # prompt 5 6 7, response 40..43 (no EOS: a cut response)
    resp = torch.tensor([[False, False, False, True, True, True, True]])
    allowed_ids = torch.tensor([40, 41, 42, 43])
    exact = []
    for b0 in range(0, ids.shape[1], K):
        pos = [p for p in range(b0, min(b0 + K, ids.shape[1])) if resp[0, p]]
        exact.append(enumerated_expectation(small_model, ids[0], b0, pos, K, rate, lam, allowed_ids) if pos else 0.0)
    L = ids.shape[1]
    rows, rresp = ids.expand(R, L).contiguous(), resp.expand(R, L)
    nz = draw_noise(rresp, K, N, 0.1, 1.0, torch.Generator().manual_seed(11), "exact_elbo")
    nz = add_substitutions(nz, rows, rresp, rate=rate, weight=lam, source="uniform", allowed_ids=allowed_ids,
                           generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        _, blocks = all_composites(small_model, rows, nz, MASK, packed=True, return_blocks=True)
    per_row = blocks.double().mean(1)
    for b in range(per_row.shape[1]):
        mean, se = per_row[:, b].mean().item(), per_row[:, b].std().item() / R ** 0.5
        assert abs(mean - exact[b]) < 4 * se + 1e-5, (b, mean, exact[b], se)
    total = per_row.sum(1)
    assert abs(total.mean().item() - sum(exact)) < 4 * total.std().item() / R ** 0.5


def test_draft_substitutes_are_model_samples_and_equal_drafts_are_not_substitutions(small_model):
    ids, resp = batch_ids()
    nz = draw_noise(resp, 4, 2, 0.1, 1.0, torch.Generator().manual_seed(4), "exact_elbo")
    chosen = choose_positions(nz, resp, 0.6, torch.Generator().manual_seed(5))
    d1 = draft_substitutes(small_model, ids, nz, chosen, MASK, torch.Generator().manual_seed(6))
    d2 = draft_substitutes(small_model, ids, nz, chosen, MASK, torch.Generator().manual_seed(6))
    assert torch.equal(d1, d2), "drafts come from the generator only"
    assert torch.equal(d1[~chosen], ids[None].expand_as(d1)[~chosen]) and not (d1 == MASK).any()
    # temperature -> 0: the draft is the argmax of the model on the input with masks at M and the chosen positions
    cold = draft_substitutes(small_model, ids, nz, chosen, MASK, torch.Generator().manual_seed(6), temperature=1e-4)
    n, i, p = [int(x) for x in chosen.nonzero()[0]]
    b0 = p - p % 4
    block = ids[i, b0:b0 + 4].masked_fill((nz.masked[n, i] | chosen[n, i])[b0:b0 + 4], MASK)
    with torch.no_grad():
        logits = small_model(torch.cat([ids[i, :b0], block])[None]).logits[0, p]
    logits[MASK] = float("-inf")
    assert int(cold[n, i, p]) == int(logits.argmax())
    nd = add_substitutions(nz, ids, resp, rate=0.6, weight=1.0, source="draft", allowed_ids=allowed(),
                           generator=torch.Generator().manual_seed(5), model=small_model, mask_token_id=MASK)
    same = chosen & (d1 == ids[None])
    assert torch.equal(nd.substituted, chosen & ~same)
    assert not (nd.weight[same]).any()


def test_config_rejects_bad_t2t_values():
    for key, value in [("t2t_weight", -1.0), ("t2t_rate", 0.0), ("t2t_rate", 1.0), ("t2t_source", "random")]:
        with pytest.raises(ValueError, match=f"learner.{key}"):
            LearnerConfig(**{key: value}).validate()
