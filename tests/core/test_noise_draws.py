"""`learner.noise: exact_elbo` (ebpo.core.noise_draws): exactly k ~ U{1..m} of a block's m response tokens masked,
weight m/k.

References written plainly here: every subset of a block enumerated (the exact ELBO of LLaDA), the
continuous-time 1/t ELBO over t in (0, 1] by quadrature, and the Monte Carlo mean of the learner's draws.

* shapes for every remainder and one draw, rows without response, n_draws >= 1;
* independence: every (row, block) draws its own offset u, hence its own k, and every draw its own uniform subset.
  A change that shares one random draw between rows or between draws keeps every marginal the other tests check
  (k uniform on 1..m, subsets uniform) and breaks only independence. Both tests use a fixed seed, so they are
  deterministic; the bound stated in each is the probability that the correct code fails it for a seed drawn at
  random, i.e. how unlucky the fixed seed would have to be;
* `exact_elbo_masks` puts every output on its generator's device, whatever the default device is (run under the
  `meta` default device it returns the same CPU tensors as without it). Not checkable on one device: moving the
  input mask onto the generator's device (a `meta` input cannot be copied to the CPU)."""
import itertools
import math

import numpy as np
import pytest
import torch

from ebpo.core.likelihood import all_composites, draw_noise, response_mask_from_ids
from ebpo.core.noise_draws import exact_elbo_masks

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


def test_rows_and_blocks_draw_their_own_k():
    """Rule: with one draw, k = floor(m u) + 1 with u ~ U[0, 1) drawn per (row, block), so over B rows of full
    blocks (m = K) the k of a block column are B independent uniforms on 1..K.

    Checked: each of the K values appears in each block column, and the two blocks of a row do not agree on
    every row. False failure for a random seed: union bound over 2 blocks x K values of (1 - 1/K)^B, plus
    K^-B for the rows all agreeing; with B = 256, K = 8: 2 * 8 * (7/8)^256 + 8^-256 < 3e-14.
    A shared draw across rows puts all B rows of a block on one k."""
    B, K = 256, 8
    assert 2 * K * (1 - 1 / K) ** B + K ** -B < 3e-14
    resp = torch.ones(B, 2 * K, dtype=torch.bool)
    masked, t, w = exact_elbo_masks(resp, K, 1, torch.Generator().manual_seed(1234))
    k = (t[0] * K).round().long()  # (B, 2): t = k / m with m = K
    assert torch.equal(k, masked[0].view(B, 2, K).sum(-1))  # t is the fraction masked
    for b in range(2):
        assert set(k[:, b].tolist()) == set(range(1, K + 1)), b
    assert not torch.equal(k[:, 0], k[:, 1])


def test_draws_mask_independent_subsets():
    """Rule: each draw masks a uniform k-subset of the block's response tokens, independently of the other
    draws. With N = 2K draws of a full block, k_n = floor(K (n + u) / N) + 1 = floor((n + u) / 2) + 1, so draws
    2j and 2j+1 share k = j + 1 (checked below); independent uniform subsets of the same size k coincide with
    probability 1 / C(K, k).

    Checked over B rows, for the pair with k = K/2 (C(8, 4) = 70): at most B/2 rows have the two draws mask
    the same subset. Their count is Binomial(B, 1/70) under the rule, so a random seed fails with probability
    P(Bin(64, 1/70) >= 32) <= C(64, 32) * 70^-32 < 1e-40. Draws sharing one set of keys mask the same subset
    in every row (and nested subsets for different k)."""
    B, K = 64, 8
    N = 2 * K
    assert math.comb(B, B // 2) * (1 / math.comb(K, K // 2)) ** (B // 2) < 1e-40
    resp = torch.ones(B, K, dtype=torch.bool)
    masked, t, w = exact_elbo_masks(resp, K, N, torch.Generator().manual_seed(99))
    k = (t[:, :, 0] * K).round().long()  # (N, B)
    want = (torch.arange(N) // 2 + 1)[:, None].expand(N, B)
    assert torch.equal(k, want)
    j = K // 2 - 1  # draws 2j, 2j + 1 have k = K / 2
    same = (masked[2 * j] == masked[2 * j + 1]).all(-1)  # (B,)
    assert int(same.sum()) <= B // 2, int(same.sum())
    # the same for every k in 2..K-2 at once (C(K, k) >= 28, pairs of different k independent): at most half
    # of the 5B pairs coincide; false failure <= C(5B, 5B/2) * 28^-(5B/2) < 2^(5B) * 28^-(5B/2) = 2^-449
    pairs = torch.stack([(masked[2 * (kk - 1)] == masked[2 * (kk - 1) + 1]).all(-1) for kk in range(2, K - 1)])
    assert int(pairs.sum()) <= pairs.numel() // 2


@pytest.mark.parametrize("K", [2, 3, 4])
def test_exact_elbo_masks_shapes_for_every_remainder_and_one_draw(K):
    for L in range(K, 3 * K + 1):
        resp = torch.zeros(2, L, dtype=torch.bool)
        resp[:, 1:] = True
        resp[1, :] = False  # a row without response: t = 1, nothing masked
        for n in (1, 3):
            masked, t, w = exact_elbo_masks(resp, K, n, torch.Generator().manual_seed(L))
            assert masked.shape == (n, 2, L) and w.shape == (n, 2, L)
            assert t.shape == (n, 2, -(-L // K))
            assert not masked[:, 1].any() and (t[:, 1] == 1).all() and (w[:, 1] == 0).all()
            assert not (masked & ~resp).any()
    with pytest.raises(ValueError, match=r"^n_draws: must be >= 1, got 0$"):
        exact_elbo_masks(resp, K, 0, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("seed", range(3))
def test_exact_elbo_masks_follow_the_generator_not_the_default_device(seed):
    g = torch.Generator().manual_seed(seed)
    B, L, K, N = 3, 11, 4, 5  # a partial last block
    resp = torch.rand(B, L, generator=g) < 0.6
    resp[0] = False  # a row without response tokens: its blocks take the t = 1 branch
    want = exact_elbo_masks(resp, K, N, torch.Generator().manual_seed(seed))
    with torch.device("meta"):
        got = exact_elbo_masks(resp, K, N, torch.Generator().manual_seed(seed))
    for w, x in zip(want, got):
        assert x.device.type == "cpu" and x.dtype == w.dtype and torch.equal(x, w)
