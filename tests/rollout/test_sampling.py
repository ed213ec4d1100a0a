"""Candidates: plain fallback against brute force, agreement with kernels.decode, sampling distribution.

Candidate sampling rules the decoding tests leave unpinned: the documented "off" values of top-k / top-p / penalty,
the nucleus tie rule, top-k = 1, fp32 Gumbel noise, sampling without generators, and the penalty applied only where
a previous token exists. Each rule checked on a class of inputs against a plain-Python reference."""
import importlib.util
import math

import pytest
import torch

from rollout.sampling import candidates, candidates_reference, filter_top_k_top_p, gumbel_noise, kernel_available


def _logits(B=3, K=4, V=11, seed=0):
    return torch.randn(B, K, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_with_softmax_prob():
    x = _logits()
    tok, prob = candidates_reference(x)
    for b in range(3):
        for k in range(4):
            p = torch.softmax(x[b, k].double(), -1)
            assert tok[b, k] == int(p.argmax()) and prob[b, k].item() == pytest.approx(float(p.max()), rel=1e-6)


def test_penalty_subtracts_from_previous_token_logit():
    x = torch.zeros(1, 2, 5)
    x[0, :, 3] = 1.0
    suppress = torch.tensor([[3, -1]])
    tok, _ = candidates_reference(x, suppress=suppress, penalty=3.0)
    assert tok[0, 0] != 3 and tok[0, 1] == 3


def test_filter_matches_brute_force():
    x = _logits(B=2, K=3, V=9, seed=1)
    y = filter_top_k_top_p(x, top_k=5, top_p=0.8)
    for b in range(2):
        for k in range(3):
            row = x[b, k].tolist()
            kth = sorted(row, reverse=True)[4]
            kept = [v if v >= kth else -math.inf for v in row]
            z = sum(math.exp(v) for v in kept if v > -math.inf)
            order = sorted(range(9), key=lambda i: -kept[i])
            mass, keep = 0.0, set()
            for i in order:
                if kept[i] == -math.inf or (mass >= 0.8 and keep):
                    break
                keep.add(i)
                mass += math.exp(kept[i]) / z
            assert {i for i in range(9) if y[b, k, i] > -math.inf} == keep


def test_sampled_prob_is_under_the_drawing_distribution_and_frequencies_match():
    x = torch.tensor([[[2.0, 1.0, 0.0, -1.0, 3.0]]])
    T, n = 0.7, 4000
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    dist = torch.softmax(filter_top_k_top_p(x[0, 0] / T, top_k=4), -1)
    for _ in range(n):
        tok, prob = candidates_reference(x, temperature=T, top_k=4, generators=[g])
        counts[tok[0, 0]] += 1
        assert prob[0, 0].item() == pytest.approx(dist[tok[0, 0]].item(), rel=1e-5)
    assert counts[3] == 0  # filtered out by top-k
    assert torch.allclose(counts / n, dist, atol=0.03)


def test_rows_draw_only_from_their_own_generator():
    x = _logits(B=3, V=50)
    a, _ = candidates_reference(x, 1.0, generators=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    b, _ = candidates_reference(x[1:2], 1.0, generators=[torch.Generator().manual_seed(2)])
    assert torch.equal(a[1], b[0])


@pytest.mark.skipif(not kernel_available(), reason="kernels.decode not importable")
@pytest.mark.parametrize("temperature,top_k,top_p,penalty", [(0.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 3.0),
                                                             (0.8, 0, 1.0, 0.0), (1.0, 5, 0.9, 2.0)])
def test_fallback_agrees_with_kernel(temperature, top_k, top_p, penalty):
    x = _logits(B=4, K=6, V=40, seed=5)
    sup = torch.randint(-1, 40, (4, 6), generator=torch.Generator().manual_seed(1))

    def gens():
        return [torch.Generator().manual_seed(10 + i) for i in range(4)] if temperature else None

    t1, p1 = candidates(x, temperature, top_k, top_p, gens(), sup, penalty, use_kernel=True)
    t2, p2 = candidates_reference(x, temperature, top_k, top_p, gens(), sup, penalty)
    assert torch.equal(t1, t2)
    torch.testing.assert_close(p1, p2)


@pytest.mark.parametrize("top_k, top_p, penalty", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.8, 2.0), (7, 0.9, 3.0)])
def test_rows_at_their_own_temperatures_equal_each_row_alone(top_k, top_p, penalty):
    """Rows sampled in one call at different temperatures get exactly the tokens and probabilities that
    `candidates` gives each row alone at its temperature, from the same generator state (a plain loop)."""
    from rollout.sampling import candidates, candidates_at_temperatures

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 50, generator=g) * 3
    suppress = torch.randint(-1, 50, (4, 6), generator=g)
    temps = [0.3, 0.7, 1.0, 1.6]
    tok, prob = candidates_at_temperatures(logits, temps, top_k, top_p,
                                           [torch.Generator().manual_seed(10 + b) for b in range(4)], suppress, penalty)
    for b, t in enumerate(temps):
        ref_tok, ref_prob = candidates(logits[b:b + 1], t, top_k, top_p, [torch.Generator().manual_seed(10 + b)],
                                       suppress[b:b + 1], penalty)
        assert torch.equal(tok[b], ref_tok[0])
        # x / t then / 1 against x / t: the same float ops, so the same bits
        assert torch.equal(prob[b], ref_prob[0])
    with pytest.raises(ValueError, match="must be > 0"):
        candidates_at_temperatures(logits, [0.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("seed", range(4))
def test_filter_defaults_are_off(seed):
    """top_k = 0 and top_p = 1.0 (the defaults, "off" in DecodeConfig) keep every token, also a token whose
    probability rounds to 0 in fp32 (so the mass before it already is 1.0)."""
    x = _logits(seed=seed)
    x[..., -1] = -200.0  # exp(-200) underflows fp32: the mass before it is exactly 1
    assert torch.equal(filter_top_k_top_p(x), x)
    assert torch.equal(filter_top_k_top_p(x, top_k=0, top_p=1.0), x)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_one_keeps_only_the_largest_logits(seed):
    x = _logits(seed=seed)
    x[0, 0, 3] = x[0, 0, 5] = x[0, 0].max() + 1.0  # a tie at the top: both kept
    y = filter_top_k_top_p(x, top_k=1)
    kept = y > float("-inf")
    assert torch.equal(kept, x == x.amax(-1, keepdim=True))
    assert torch.equal(y[kept], x[kept])


@pytest.mark.parametrize("n,top_p,expect", [(4, 0.5, 2), (4, 0.25, 1), (4, 0.75, 3), (8, 0.5, 4), (8, 0.125, 1)])
def test_nucleus_drops_a_token_once_the_mass_before_it_reaches_top_p(n, top_p, expect):
    """n equally likely tokens (1/n exact in fp32): the mass strictly before the j-th is j/n, so the kept count
    is the smallest j with j/n >= top_p (a token whose preceding mass equals top_p is dropped)."""
    y = filter_top_k_top_p(torch.zeros(2, n), top_p=top_p)
    assert ((y > float("-inf")).sum(-1) == expect).all()


def test_gumbel_noise_is_fp32_whatever_the_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        u = gumbel_noise((3, 5), torch.Generator().manual_seed(0), torch.device("cpu"))
        v = gumbel_noise((3, 5), None, torch.device("cpu"))
    finally:
        torch.set_default_dtype(old)
    assert u.dtype == torch.float32 and v.dtype == torch.float32


@pytest.mark.parametrize("B,K", [(5, 2), (2, 5), (1, 1)])
def test_sampling_without_generators_draws_from_the_global_rng(B, K):
    """generators None at temperature > 0: every row samples from torch's global generator (reproducible under
    torch.manual_seed), from the filtered distribution, for any number of rows and block positions."""
    x = _logits(B=B, K=K, V=7, seed=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        t1, p1 = candidates_reference(x, temperature=0.9, top_k=3)
        torch.manual_seed(11)
        t2, p2 = candidates_reference(x, temperature=0.9, top_k=3)
    assert torch.equal(t1, t2) and torch.equal(p1, p2)
    allowed = filter_top_k_top_p(x / 0.9, top_k=3) > float("-inf")
    assert allowed.gather(-1, t1[..., None]).all()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reference_defaults_are_off(temperature):
    """Defaults top_k = 0, top_p = 1.0, penalty = 0 give the same draws and probabilities as naming them, also
    when a suppress tensor is passed (no penalty without a penalty value)."""
    x = _logits(B=3, K=4, V=9, seed=4)
    sup = torch.randint(-1, 9, (3, 4), generator=torch.Generator().manual_seed(2))

    def gens():
        return [torch.Generator().manual_seed(20 + i) for i in range(3)] if temperature else None

    ref = candidates_reference(x, temperature, 0, 1.0, gens(), None, 0.0)
    for got in (candidates_reference(x, temperature, generators=gens()),
                candidates_reference(x, temperature, generators=gens(), suppress=sup)):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_penalty_without_suppress_changes_nothing():
    x = _logits(seed=6)
    a = candidates_reference(x, penalty=3.0)
    b = candidates_reference(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("seed", range(3))
def test_greedy_penalty_matches_a_plain_loop(seed):
    """Temperature 0 with a penalty: subtract it from logit suppress[b, k] only where suppress >= 0 (-1: no
    previous token), then tok = argmax and prob = its softmax probability, all in fp64 here."""
    B, K, V, pen = 3, 5, 8, 2.5
    x = _logits(B=B, K=K, V=V, seed=seed)
    sup = torch.randint(-1, V, (B, K), generator=torch.Generator().manual_seed(seed + 10))
    sup[:, 0] = -1
    tok, prob = candidates_reference(x, suppress=sup, penalty=pen)
    for b in range(B):
        for k in range(K):
            row = [float(v) for v in x[b, k]]
            if sup[b, k] >= 0:
                row[int(sup[b, k])] -= pen
            best = max(range(V), key=lambda i: row[i])
            z = sum(math.exp(v - row[best]) for v in row)
            assert int(tok[b, k]) == best
            # fp32 softmax of O(10) logits over V = 8 terms: a few fp32 ulps of a number <= 1
            assert float(prob[b, k]) == pytest.approx(1.0 / z, rel=1e-5)


def test_kernel_available_says_whether_kernels_decode_imports():
    try:
        importable = importlib.util.find_spec("kernels.decode") is not None
        if importable:
            importlib.import_module("kernels.decode")
    except ImportError:
        importable = False
    assert kernel_available() == importable


@pytest.mark.parametrize("temperature,top_k,top_p,penalty", [(0.0, 0, 1.0, 0.0), (0.0, 3, 0.7, 2.0),
                                                             (0.8, 0, 1.0, 0.0), (1.3, 4, 0.8, 1.5)])
def test_candidates_without_the_kernel_is_the_reference(temperature, top_k, top_p, penalty):
    """use_kernel=False: every argument goes to `candidates_reference` unchanged (same draws, same probabilities)."""
    from rollout.sampling import candidates

    x = _logits(B=3, K=5, V=12, seed=8)
    sup = torch.randint(-1, 12, (3, 5), generator=torch.Generator().manual_seed(3))

    def gens():
        return [torch.Generator().manual_seed(40 + i) for i in range(3)] if temperature else None

    got = candidates(x, temperature, top_k, top_p, gens(), sup, penalty, use_kernel=False)
    ref = candidates_reference(x, temperature, top_k, top_p, gens(), sup, penalty)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_candidates_defaults_are_greedy_and_filters_off():
    from rollout.sampling import candidates

    x = _logits(B=2, K=3, V=10, seed=9)
    sup = torch.randint(-1, 10, (2, 3), generator=torch.Generator().manual_seed(4))
    ref = candidates_reference(x)
    for got in (candidates(x), candidates(x, suppress=sup), candidates(x, use_kernel=False)):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    g = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    h = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    a, b = candidates(x, 0.9, generators=g), candidates_reference(x, 0.9, 0, 1.0, h)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_candidates_dispatch_to_the_kernel_only_when_asked_and_available(monkeypatch):
    import rollout.sampling as sampling

    calls = []

    def spy(*args):
        calls.append(args)
        return candidates_reference(*args)

    x = _logits(B=2, K=2, V=6, seed=10)
    monkeypatch.setattr(sampling, "_kernel_candidates", spy)
    sampling.candidates(x)
    assert len(calls) == 1 and calls[0][0] is x  # available and asked (the default): the kernel runs
    sampling.candidates(x, use_kernel=False)
    assert len(calls) == 1  # not asked: the reference
    monkeypatch.setattr(sampling, "_kernel_candidates", None)
    tok, prob = sampling.candidates(x)  # not available: the reference, no error
    assert torch.equal(tok, candidates_reference(x)[0])


def test_candidates_are_the_same_under_a_float64_default_dtype():
    """The penalty and the Gumbel noise are built in fp32 whatever torch's default dtype is, so a caller that
    switched it to float64 gets the same draws and probabilities."""
    x = _logits(B=2, K=4, V=9, seed=12)
    sup = torch.randint(-1, 9, (2, 4), generator=torch.Generator().manual_seed(5))

    def draw():
        return candidates_reference(x, 0.7, 0, 1.0, [torch.Generator().manual_seed(s) for s in (1, 2)], sup, 1.5)

    ref = draw()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = draw()
    finally:
        torch.set_default_dtype(old)
    assert torch.equal(got[0], ref[0]) and got[1].dtype == torch.float32 and torch.equal(got[1], ref[1])


def test_sampled_candidates_are_drawn_on_the_generators_device_whatever_the_default_device():
    """Each row's Gumbel noise is drawn on its generator's device and moved to the logits' device: under a `meta`
    default device, with CPU logits and generators, the candidates are the same (a draw or a tensor made on the
    default device would be `meta`)."""
    logits = torch.randn(3, 4, 9, generator=torch.Generator().manual_seed(0))

    def run():
        gens = [torch.Generator().manual_seed(10 + b) for b in range(3)]
        return candidates_reference(logits, 0.8, 4, 0.9, gens)

    want = run()
    with torch.device("meta"):
        got = run()
    for w, g in zip(want, got):
        assert g.device.type == "cpu" and torch.equal(g, w)
    noise = gumbel_noise((2, 5), torch.Generator().manual_seed(3), "cpu")
    with torch.device("meta"):
        again = gumbel_noise((2, 5), torch.Generator().manual_seed(3), "cpu")
    assert again.device.type == "cpu" and torch.equal(again, noise)
