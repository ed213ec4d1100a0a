"""Editing-aware composite (ebpo.core.editing: M2T masks + T2T substitutions) against references written plainly here.

* every layout (unpacked, packed, KV-cached, one forward per block) equals a per-block loop that builds
  each noisy block by hand and reads full logits;
* no substitution (and `t2t_weight = 0` in the learner) is the mask-only composite bit for bit, and the
  learner's M2T draws and minibatch order are not perturbed by the T2T draws;
* the estimator's expectation equals an enumeration of every mask subset, substitution subset and
  substitute token on a tiny case;
* drafts are the model's own samples, never the mask token, and a draft equal to the clean token is no
  substitution.

The rules of the draws:

* the settings' bounds and messages (t2t_weight >= 0, t2t_rate in the open (0, 1), a known source), with the
  key's prefix;
* t2t_seed gives a distinct seed in [0, 2^63) for every (seed, update);
* each draw chooses its substituted positions with its own coins;
* every random choice comes from the generator passed in (the global RNG changes nothing);
* the sources: `draft` substitutes the model's own sample at every chosen position, `uniform` a uniform token,
  `mixed` one or the other with probability 1/2 each; draft and mixed need the model and the mask id;
* the draws (and `noisy_half_hidden`) make their tensors on the inputs' device (tests/support/devices.py)."""
import copy
import itertools
import math

import pytest
import torch

from ebpo.core.editing import add_substitutions, check_t2t, choose_positions, draft_substitutes, t2t_seed
from ebpo.core.likelihood import NoiseDraws, all_composites, composite_logprobs_blockwise, draw_noise
from ebpo.core.noise import substitution_ids
from ebpo.core.objectives import noisy_half_hidden
from ebpo.rl.learner import EBPOLearner, LearnerConfig
from tests.support.devices import assert_same, under_default

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


TOKEN = 77


def test_check_t2t_bounds_and_messages():
    for w, r, s in [(0.0, 1e-6, "uniform"), (0.3, 0.5, "draft"), (2.0, 1 - 1e-6, "mixed")]:
        check_t2t(w, r, s)
    bad = [((-1e-9, 0.5, "uniform"), r"t2t_weight: must be >= 0 \(0 = mask-only composite\), got -1e-09"),
           ((float("nan"), 0.5, "uniform"), r"t2t_weight: must be >= 0 \(0 = mask-only composite\), got nan"),
           ((0.1, 0.0, "uniform"), r"t2t_rate: must lie in \(0, 1\), got 0.0"),
           ((0.1, 1.0, "uniform"), r"t2t_rate: must lie in \(0, 1\), got 1.0"),
           ((0.1, 1.5, "uniform"), r"t2t_rate: must lie in \(0, 1\), got 1.5"),
           ((0.1, -0.2, "uniform"), r"t2t_rate: must lie in \(0, 1\), got -0.2"),
           ((0.1, 0.5, "random"), r"t2t_source: choose one of \['uniform', 'draft', 'mixed'\], got 'random'")]
    for args, msg in bad:
        with pytest.raises(ValueError, match="^learner." + msg + "$"):
            check_t2t(*args)
        with pytest.raises(ValueError, match="^x." + msg + "$"):
            check_t2t(*args, prefix="x.")
    ids, resp, nz = _batch(1)
    with pytest.raises(ValueError, match=r"^t2t_rate: must lie in \(0, 1\), got 0.0$"):  # no prefix here
        add_substitutions(nz, ids, resp, rate=0.0, weight=1.0, source="uniform", allowed_ids=_allowed(),
                          generator=torch.Generator().manual_seed(0))


def test_t2t_seed_is_a_distinct_63_bit_seed_per_update():
    pairs = [(s, u) for s in list(range(30)) + [2 ** 40, 2 ** 62 - 1] for u in list(range(30)) + [10 ** 9]]
    seeds = [t2t_seed(s, u) for s, u in pairs]
    assert all(0 <= x < 2 ** 63 and type(x) is int for x in seeds)
    assert len(set(seeds)) == len(pairs)
    assert t2t_seed(3, 4) == t2t_seed(3, 4)  # a function of (seed, update) only
    torch.Generator().manual_seed(max(seeds))  # every value is a valid seed


def _allowed(vocab=128):
    return substitution_ids(vocab, [MASK, BOS])


def _batch(n_draws, B=4, L=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    resp[:, 4:] = True
    return ids, resp, draw_noise(resp, 4, n_draws, 0.1, 0.6, g)


def test_draws_choose_their_positions_with_their_own_coins():
    """No masks, every position a response position, rate 1/2: each draw's chosen set is B*L fair coins, so
    two draws agree everywhere with probability 2^-(B L) = 2^-128 (the false-failure rate for a random seed)."""
    B, L, N = 4, 32, 3
    nz = NoiseDraws(masked=torch.zeros(N, B, L, dtype=torch.bool), t=torch.ones(N, B, L // 4),
                    weight=torch.zeros(N, B, L), block_size=4)
    chosen = choose_positions(nz, torch.ones(B, L, dtype=torch.bool), 0.5, torch.Generator().manual_seed(1))
    for a in range(N):
        for b in range(a + 1, N):
            assert not torch.equal(chosen[a], chosen[b]), (a, b)


def _stub_model(small_model):
    """small_model whose output head puts all probability on TOKEN (zero weights, a bias of 100 there): its
    draft at every chosen position is TOKEN."""
    m = copy.deepcopy(small_model)
    head = torch.nn.Linear(m.lm_head.in_features, m.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[TOKEN] = 100.0
    m.lm_head = head
    return m


@pytest.mark.parametrize("source", ["uniform", "draft", "mixed"])
def test_random_choices_come_from_the_generator_only(small_model, source):
    ids, resp, nz = _batch(2)
    outs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        outs.append(add_substitutions(nz, ids, resp, rate=0.5, weight=1.0, source=source, allowed_ids=_allowed(),
                                      generator=torch.Generator().manual_seed(9), model=small_model,
                                      mask_token_id=MASK))
    a, b = outs
    assert torch.equal(a.substituted, b.substituted) and torch.equal(a.sub_ids, b.sub_ids)
    assert torch.equal(a.weight, b.weight) and a.substituted.any()


def test_sources_draft_uniform_and_mixed(small_model):
    """Chosen positions hold clean tokens in 5..59, never TOKEN, so the stub's draft is always a substitution.

    draft: every substitute is TOKEN. uniform: TOKEN has probability 1/|allowed minus clean| = 1/125 each.
    mixed: TOKEN with probability 1/2 + 1/250. Over n >= 200 substituted positions (checked), the count of
    TOKEN is Binomial: asserted in (n/4, 3n/4) for mixed and below n/4 for uniform; by Hoeffding a random seed
    fails either with probability <= 2 exp(-2 n (1/4 - 1/250)^2) < 7e-11."""
    model = _stub_model(small_model)
    ids, resp, nz = _batch(4, B=8, L=32, seed=3)
    counts = {}
    for source in ("draft", "uniform", "mixed"):
        d = add_substitutions(nz, ids, resp, rate=0.5, weight=1.0, source=source, allowed_ids=_allowed(),
                              generator=torch.Generator().manual_seed(11), model=model, mask_token_id=MASK)
        n = int(d.substituted.sum())
        assert n >= 200, n
        counts[source] = (int((d.sub_ids[d.substituted] == TOKEN).sum()), n)
    assert 2 * math.exp(-2 * 200 * (0.25 - 1 / 250) ** 2) < 7e-11
    hit, n = counts["draft"]
    assert hit == n
    hit, n = counts["uniform"]
    assert hit < n / 4
    hit, n = counts["mixed"]
    assert n / 4 < hit < 3 * n / 4


def test_draft_and_mixed_need_the_model_and_the_mask_id(small_model):
    ids, resp, nz = _batch(1)
    for source in ("draft", "mixed"):
        for model, mask in [(None, MASK), (small_model, None), (None, None)]:
            with pytest.raises(ValueError, match=rf"^t2t_source='{source}' needs the model and the mask token id$"):
                add_substitutions(nz, ids, resp, rate=0.5, weight=1.0, source=source, allowed_ids=_allowed(),
                                  generator=torch.Generator().manual_seed(0), model=model, mask_token_id=mask)


def test_t2t_stats_is_the_mean_count_per_draw_and_sequence():
    from ebpo.core.editing import t2t_stats
    g = torch.Generator().manual_seed(0)
    for N, B, L in [(2, 3, 7), (1, 1, 5), (3, 2, 2)]:
        sub = torch.rand(N, B, L, generator=g) < 0.4
        nz = NoiseDraws(masked=torch.zeros(N, B, L, dtype=torch.bool), t=torch.ones(N, B, 1),
                        weight=torch.zeros(N, B, L), block_size=L, substituted=sub, sub_ids=torch.zeros(N, B, L))
        want = sum(int(sub[n, b].sum()) for n in range(N) for b in range(B)) / (N * B)
        assert t2t_stats(nz) == {"likelihood/substituted_per_seq": pytest.approx(want, abs=1e-6)}
    nz = NoiseDraws(masked=torch.zeros(1, 1, 2, dtype=torch.bool), t=torch.ones(1, 1, 1), weight=torch.zeros(1, 1, 2),
                    block_size=2)
    assert t2t_stats(nz) == {"likelihood/substituted_per_seq": 0.0}


DEL, INS, K = 105, 106, 4


def _device_batch(B=3, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate([3, 6, 1][:B]):
        resp[b, p:] = True
    return ids, resp, draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(seed + 1))


def test_noisy_half_hidden_and_editing_draws_follow_the_inputs_device(small_model):
    ids, resp, noise = _device_batch()
    allowed = torch.arange(10, 60)
    outs = {}
    for dev in (None, "meta"):
        with torch.no_grad(), under_default(dev):
            outs[dev] = (noisy_half_hidden(small_model, ids.masked_fill(resp, MASK), ids, K),
                         choose_positions(noise, resp, 0.5, torch.Generator().manual_seed(3)),
                         add_substitutions(noise, ids, resp, rate=0.5, weight=0.7, source="uniform",
                                           allowed_ids=allowed, generator=torch.Generator().manual_seed(4)),
                         add_substitutions(noise, ids, resp, rate=0.5, weight=0.7, source="mixed",
                                           allowed_ids=allowed, generator=torch.Generator().manual_seed(5),
                                           model=small_model, mask_token_id=MASK))
    for w, g in zip(outs[None], outs["meta"]):
        assert_same(w, g)
    assert outs[None][1].any() and outs[None][2].substituted.any()
