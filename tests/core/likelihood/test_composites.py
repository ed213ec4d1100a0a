"""Block-ELBO composites (ebpo.core.likelihood) against independent references written plainly here."""
import copy
import itertools

import numpy as np
import pytest
import torch

from ebpo.core.algos import ebpo_loss
from ebpo.core.likelihood import (all_composites, direct_backward, draw_noise, replay_backward,
                             response_mask_from_ids)


MASK, EOS = 2, 1


def make_batch(B=3, L=14, eos=EOS, seed=0, prompt_lens=(3, 5, 2), eos_at=(9, 12, None)):
    """Right-padded ids with varied prompt lengths; EOS at the given absolute positions (pad = EOS after it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, L), generator=g)
    for i, e in enumerate(eos_at[:B]):
        if e is not None:
            ids[i, e:] = eos
    return ids, torch.tensor(prompt_lens[:B])


def plain_response_mask(ids, prompt_lens, eos):
    out = torch.zeros_like(ids, dtype=torch.bool)
    for i in range(ids.shape[0]):
        for p in range(int(prompt_lens[i]), ids.shape[1]):
            out[i, p] = True
            if int(ids[i, p]) == eos:
                break
    return out


def test_response_mask_matches_plain_loop():
    ids, pl = make_batch()
    ids[1, 2] = EOS  # an EOS inside the prompt does not end the response
    assert torch.equal(response_mask_from_ids(ids, pl, EOS), plain_response_mask(ids, pl, EOS))


def test_noise_draws_are_stratified_forced_and_response_only():
    ids, pl = make_batch(B=3, L=14)
    resp = response_mask_from_ids(ids, pl, EOS)
    K, N, a, b = 4, 5, 0.2, 0.9
    nz = draw_noise(resp, K, N, a, b, torch.Generator().manual_seed(3))
    assert not (nz.masked & ~resp[None]).any(), "only response tokens may be masked"
    width = (b - a) / N
    for n in range(N):  # draw n's level lies in stratum n of [a, b]
        assert ((nz.t[n] >= a + n * width - 1e-6) & (nz.t[n] <= a + (n + 1) * width + 1e-6)).all()
    for i in range(3):
        for blk in range(0, 14, K):
            if resp[i, blk:blk + K].any():
                assert nz.masked[:, i, blk:blk + K].any(dim=1).all(), "every response block has a masked token"
    expected_w = torch.where(nz.masked, 1.0 / nz.t[:, :, torch.arange(14) // K], torch.zeros(()))
    assert torch.allclose(nz.weight, expected_w)


def reference_composite(model, ids, masked, t, K):
    """Per-block loop: block b scored by its own forward over [clean blocks < b ; noisy block b], full logits."""
    B, L = ids.shape
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        for b0 in range(0, L, K):
            m = masked[i, b0:b0 + K]
            if not m.any():
                continue
            block = ids[i, b0:b0 + K].clone()
            block[m] = MASK
            x = torch.cat([ids[i, :b0], block])[None]
            logp = model(x).logits[0, b0:].double().log_softmax(-1)  # default mask = block-causal
            for j in m.nonzero().flatten().tolist():
                out[i] += logp[j, ids[i, b0 + j]] / float(t[i, b0 // K])
    return out


@pytest.mark.parametrize("layout", ["unpacked", "packed", "cached"])
def test_vectorized_equals_per_block_loop(small_model, layout):
    ids, pl = make_batch(B=3, L=14)
    resp = response_mask_from_ids(ids, pl, EOS)
    nz = draw_noise(resp, 4, 3, 0.1, 1.0, torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = all_composites(small_model, ids, nz, MASK, packed=layout == "packed", cached=layout == "cached")
        for n in range(3):
            ref = reference_composite(small_model, ids, nz.masked[n], nz.t[n], 4)
            assert torch.allclose(got[:, n].double(), ref, rtol=1e-4, atol=1e-4), (n, got[:, n], ref)


def test_packed_equals_unpacked_in_chunks(small_model):
    ids, pl = make_batch(B=3, L=14, seed=5)
    resp = response_mask_from_ids(ids, pl, EOS)
    nz = draw_noise(resp, 4, 6, 0.1, 1.0, torch.Generator().manual_seed(2))
    with torch.no_grad():
        unpacked = all_composites(small_model, ids, nz, MASK, packed=False, chunk=1)
        packed_all = all_composites(small_model, ids, nz, MASK, packed=True, chunk=0)
        packed_2 = all_composites(small_model, ids, nz, MASK, packed=True, chunk=4)  # chunks 4 + 2
        cached_2, blocks = all_composites(small_model, ids, nz, MASK, cached=True, chunk=4, return_blocks=True)
    assert torch.allclose(packed_all, unpacked, atol=1e-4)
    assert torch.allclose(packed_2, unpacked, atol=1e-4)
    assert torch.allclose(cached_2, unpacked, atol=1e-4)
    assert torch.allclose(blocks.sum(-1), cached_2, atol=1e-4)


def exact_block_expectation(model, ids_row, b0, resp_pos, K, t_min, t_max):
    """E_{t ~ U[t_min,t_max]} E_{mask ~ Bernoulli(t) with forcing} [(1/t) sum_{masked} log p], by enumeration.

    Forcing rule: when no response token of the block is masked, one of the m response tokens is masked,
    uniformly. The t-integral is done by Gauss-Legendre quadrature in float64.
    """
    m = len(resp_pos)
    score = {}
    for pattern in itertools.product([0, 1], repeat=m):
        if not any(pattern):
            continue
        chosen = [p for p, on in zip(resp_pos, pattern) if on]
        block = ids_row[b0:b0 + K].clone()
        for p in chosen:
            block[p - b0] = MASK
        x = torch.cat([ids_row[:b0], block])[None]
        with torch.no_grad():
            logp = model(x).logits[0, b0:].double().log_softmax(-1)
        score[pattern] = sum(float(logp[p - b0, ids_row[p]]) for p in chosen)
    nodes, w = np.polynomial.legendre.leggauss(60)
    ts = 0.5 * (t_max - t_min) * nodes + 0.5 * (t_max + t_min)
    total = 0.0
    for t, wt in zip(ts, w):
        e = 0.0
        for pattern, s in score.items():
            k = sum(pattern)
            e += t ** k * (1 - t) ** (m - k) * s
        singles = [score[tuple(int(j == i) for j in range(m))] for i in range(m)]
        e += (1 - t) ** m * sum(singles) / m
        total += wt * 0.5 * e / t  # 0.5*(b-a)*sum w f / (b-a) = mean over U[a,b]
    return total


def test_estimator_is_unbiased_by_enumeration(small_model):
    K, t_min, t_max, N, R = 4, 0.2, 1.0, 2, 3000
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 43, 44, 45, EOS, EOS, EOS]])
    prompt_len = 3
    resp = response_mask_from_ids(ids, torch.tensor([prompt_len]), EOS)
    L = ids.shape[1]
    exact = []
    for b0 in range(0, L, K):
        pos = [p for p in range(b0, min(b0 + K, L)) if resp[0, p]]
        exact.append(exact_block_expectation(small_model, ids[0], b0, pos, K, t_min, t_max) if pos else 0.0)
    rows = ids.expand(R, L).contiguous()
    nz = draw_noise(resp.expand(R, L), K, N, t_min, t_max, torch.Generator().manual_seed(11))
    with torch.no_grad():
        _, blocks = all_composites(small_model, rows, nz, MASK, packed=True, return_blocks=True)
    per_row = blocks.double().mean(1)  # (R, nb): the estimator (1/N) sum_n of each block's term
    for b in range(per_row.shape[1]):
        mean, se = per_row[:, b].mean().item(), per_row[:, b].std().item() / R ** 0.5
        assert abs(mean - exact[b]) < 4 * se + 1e-6, (b, mean, exact[b], se)
    total = per_row.sum(1)
    assert abs(total.mean().item() - sum(exact)) < 4 * total.std().item() / R ** 0.5


def test_gradient_replay_equals_direct_backprop(small_model):
    ids, pl = make_batch(B=3, L=14, seed=7)
    resp = response_mask_from_ids(ids, pl, EOS)
    nz = draw_noise(resp, 4, 4, 0.1, 1.0, torch.Generator().manual_seed(4))
    m1, m2 = copy.deepcopy(small_model).train(), copy.deepcopy(small_model).train()
    with torch.no_grad():
        base = all_composites(m1, ids, nz, MASK)
    g = torch.Generator().manual_seed(0)
    old = base + 0.3 * torch.randn(base.shape, generator=g)  # some sequences clipped, some not
    ref = base + 0.5 * torch.randn(base.shape, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.7])

    def loss_fn(c):
        return ebpo_loss(c, old, adv, 0.2, 0.28, lengths=resp.sum(1).float(), ref=ref, kl_beta=0.1)

    l1, _, _ = direct_backward(m1, ids, nz, MASK, loss_fn, packed=False)
    l2, _, _ = replay_backward(m2, ids, nz, MASK, loss_fn, packed=True, nograd_chunk=0, replay_chunk=1, cached=True)
    assert torch.allclose(l1, l2, atol=1e-5)
    n_checked = 0
    for (name, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        if p1.grad is None:
            assert p2.grad is None or p2.grad.abs().max() == 0, name
            continue
        n_checked += 1
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-3, atol=1e-6), (name, (p1.grad - p2.grad).abs().max())
    assert n_checked > 10


def test_response_mask_agrees_with_rl_batch_layout():
    from ebpo.rl.records import build_learner_batch

    prompts = [[0, 5, 6], [0, 7], [0, 8, 9, 10]]
    responses = [[20, 21, EOS], [22, 23, 24, 25, 26], [27, EOS]]  # the second one was cut (no EOS)
    b = build_learner_batch(prompts, responses, torch.zeros(3), torch.arange(3), pad_id=EOS)
    got = response_mask_from_ids(b.input_ids, b.prompt_lens, EOS,
                                 seq_lens=b.prompt_lens + b.response_lens)
    assert torch.equal(got, b.response_mask)
