"""Candidates: plain fallback against brute force, agreement with kernels.decode, sampling distribution."""
import math

import pytest
import torch

from rollout.sampling import candidates, candidates_reference, filter_top_k_top_p, kernel_available


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
