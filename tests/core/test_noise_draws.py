"""`learner.noise: exact_elbo`: exactly k ~ U{1..m} of a block's m response tokens masked, weight m/k.

References written plainly here: every subset of a block enumerated (the exact ELBO of LLaDA), the
continuous-time 1/t ELBO over t in (0, 1] by quadrature, and the Monte Carlo mean of the learner's draws.
"""
import itertools
import math

import numpy as np
import pytest
import torch

from ebpo.core.likelihood import all_composites, draw_noise, response_mask_from_ids

MASK, EOS = 2, 1


def test_exact_elbo_draws_mask_exactly_k_with_weight_m_over_k():
    g = torch.Generator().manual_seed(0)
    resp = torch.zeros(3, 14, dtype=torch.bool)
    resp[0, 3:10] = True
    resp[1, 5:14] = True
    resp[2, 2:4] = True
    K, N = 4, 5
    nz = draw_noise(resp, K, N, 0.1, 1.0, g, form="exact_elbo")
    assert not (nz.masked & ~resp[None]).any(), "only response tokens may be masked"
    for i in range(3):
        for b in range(0, 14, K):
            m = int(resp[i, b:b + K].sum())
            for n in range(N):
                k = int(nz.masked[n, i, b:b + K].sum())
                if m == 0:
                    assert k == 0
                    continue
                assert 1 <= k <= m
                assert nz.t[n, i, b // K].item() == pytest.approx(k / m)
                w = nz.weight[n, i, b:b + K][nz.masked[n, i, b:b + K]]
                assert torch.all(w == m / k)  # exact: m/k, not 1/(k/m)
            # stratified: the N draws' k values are non-decreasing in n
            ks = [int(nz.masked[n, i, b:b + K].sum()) for n in range(N)]
            assert ks == sorted(ks)
    assert (nz.weight[~nz.masked] == 0).all()


def test_exact_elbo_k_is_uniform_and_subsets_are_uniform():
    """A uniformly chosen draw has k uniform on {1..m}; given k, every k-subset is equally likely."""
    R, K, N = 6000, 4, 3
    resp = torch.zeros(R, 4, dtype=torch.bool)
    resp[:, 1:4] = True  # m = 3
    nz = draw_noise(resp, K, N, 0.1, 1.0, torch.Generator().manual_seed(1), form="exact_elbo")
    k = nz.masked.sum(-1).flatten()  # (N * R,)
    freq = torch.bincount(k, minlength=4)[1:].double() / k.numel()
    assert torch.allclose(freq, torch.full((3,), 1 / 3, dtype=torch.double), atol=0.015), freq
    pats = nz.masked[..., 1:].reshape(-1, 3)
    bits = torch.tensor([4, 2, 1])
    for kk in (1, 2):  # 3 subsets each
        sel = pats[k == kk]
        counts = torch.bincount((sel.long() * bits).sum(-1), minlength=8).double()
        codes = [sum(int(bits[j]) for j in c) for c in itertools.combinations(range(3), kk)]
        share = counts[codes] / len(sel)
        assert torch.allclose(share, torch.full((3,), 1 / 3, dtype=torch.double), atol=0.03), share


def block_scores(model, ids_row, b0, resp_pos, K):
    """log p of the masked tokens of block b0 for every non-empty subset of its response positions."""
    score = {}
    for pattern in itertools.product([0, 1], repeat=len(resp_pos)):
        if not any(pattern):
            continue
        chosen = [p for p, on in zip(resp_pos, pattern) if on]
        block = ids_row[b0:b0 + K].clone()
        for p in chosen:
            block[p - b0] = MASK
        x = torch.cat([ids_row[:b0], block])[None]
        with torch.no_grad():
            logp = model(x).logits[0, b0:].double().log_softmax(-1)  # default mask: block-causal
        score[pattern] = sum(float(logp[p - b0, ids_row[p]]) for p in chosen)
    return score


def exact_elbo_by_subsets(score, m):
    """E_{k ~ U{1..m}} E_{|S| = k} [(m/k) score(S)], every subset enumerated."""
    total = 0.0
    for k in range(1, m + 1):
        subsets = [p for p in score if sum(p) == k]
        assert len(subsets) == math.comb(m, k)
        total += (1 / m) * (m / k) * sum(score[p] for p in subsets) / len(subsets)
    return total


def continuous_elbo(score, m):
    """int_0^1 (1/t) E_{M ~ Bernoulli(t)^m} [score(M)] dt (the 1/t ELBO, no truncation, no forcing)."""
    nodes, w = np.polynomial.legendre.leggauss(80)
    ts = 0.5 * nodes + 0.5
    total = 0.0
    for t, wt in zip(ts, w):
        e = sum(t ** sum(p) * (1 - t) ** (m - sum(p)) * s for p, s in score.items())
        total += 0.5 * wt * e / t
    return total


def test_exact_elbo_estimator_is_unbiased_by_enumeration(small_model):
    K, N, R = 4, 2, 3000
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 43, 44, 45, EOS, EOS, EOS]])
    resp = response_mask_from_ids(ids, torch.tensor([3]), EOS)  # blocks hold m = 1, 4, 2 response tokens
    L = ids.shape[1]
    exact = []
    for b0 in range(0, L, K):
        pos = [p for p in range(b0, b0 + K) if resp[0, p]]
        score = block_scores(small_model, ids[0], b0, pos, K)
        e = exact_elbo_by_subsets(score, len(pos))
        # the subset form is the 1/t ELBO itself, not an approximation of it
        assert e == pytest.approx(continuous_elbo(score, len(pos)), rel=1e-9, abs=1e-9)
        exact.append(e)
    rows = ids.expand(R, L).contiguous()
    nz = draw_noise(resp.expand(R, L), K, N, 0.1, 1.0, torch.Generator().manual_seed(11), form="exact_elbo")
    with torch.no_grad():
        _, blocks = all_composites(small_model, rows, nz, MASK, packed=True, return_blocks=True)
    per_row = blocks.double().mean(1)  # (R, nb): the estimator (1/N) sum_n of each block's term
    for b in range(per_row.shape[1]):
        mean, se = per_row[:, b].mean().item(), per_row[:, b].std().item() / R ** 0.5
        assert abs(mean - exact[b]) < 4 * se + 1e-5, (b, mean, exact[b], se)  # m = 1: no noise, fp32 only
    total = per_row.sum(1)
    assert abs(total.mean().item() - sum(exact)) < 4 * total.std().item() / R ** 0.5


def test_unknown_noise_form_is_rejected():
    with pytest.raises(ValueError, match="noise form"):
        draw_noise(torch.ones(1, 4, dtype=torch.bool), 4, 2, 0.1, 1.0, torch.Generator(), form="uniform")
