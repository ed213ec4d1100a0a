"""Rules of the editing-aware draws (ebpo/core/editing.py) that the composite tests leave open (issue 40):

* the settings' bounds and messages (t2t_weight >= 0, t2t_rate in the open (0, 1), a known source), with the
  key's prefix;
* t2t_seed gives a distinct seed in [0, 2^63) for every (seed, update);
* each draw chooses its substituted positions with its own coins;
* every random choice comes from the generator passed in (the global RNG changes nothing);
* the sources: `draft` substitutes the model's own sample at every chosen position, `uniform` a uniform token,
  `mixed` one or the other with probability 1/2 each; draft and mixed need the model and the mask id.
"""
import copy
import math

import pytest
import torch

from ebpo.core.editing import add_substitutions, check_t2t, choose_positions, t2t_seed
from ebpo.core.likelihood import NoiseDraws, draw_noise
from ebpo.core.noise import substitution_ids

MASK, BOS, TOKEN = 2, 0, 77


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
