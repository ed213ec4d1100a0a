"""The decoupled off-policy EBPO loss (ebpo.core.offpolicy) against a plain per-sequence reference: truncated
importance weights, length normalisation, the dual clip, a cap of exactly 1 and its metrics; the weights carry no
gradient, and a behaviour policy equal to the proximal one gives the on-policy loss bit for bit."""
import math

import pytest
import torch

from ebpo.core.algos import ebpo_loss
from ebpo.core.offpolicy import decoupled_ebpo_loss, truncated_importance_weights


def _reference(cur, prox, behav, adv, eps_low, eps_high, cap, lengths=None, dual_clip=None):
    """The decoupled objective written out one sequence at a time, in probability space."""
    total = 0.0
    for i in range(cur.shape[0]):
        n = 1.0 if lengths is None else max(float(lengths[i]), 1.0)
        rho = math.exp(float((cur[i] - prox[i]).mean()) / n)
        w = min(math.exp(float((prox[i] - behav[i]).mean()) / n), cap)
        a = float(adv[i])
        obj = min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
        if dual_clip is not None and a < 0:
            obj = max(obj, dual_clip * a)
        total += w * obj
    return -total / cur.shape[0]


def _data(seed, B=10, N=3):
    g = torch.Generator().manual_seed(seed)
    prox = torch.randn(B, N, generator=g) * 5 - 30
    behav = prox + torch.randn(B, N, generator=g) * 3  # summed log-ratios of several nats: length matters
    cur = prox + torch.randn(B, N, generator=g) * 2
    adv = torch.randn(B, generator=g)
    adv[0] = -1.5
    cur[0] = prox[0] + 6.0  # a large ratio on a negative advantage: the dual clip binds there
    lengths = torch.randint(1, 12, (B,), generator=g)
    return cur, prox, behav, adv, lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_loss_with_lengths_and_dual_clip_matches_the_reference(seed):
    cur, prox, behav, adv, lengths = _data(seed)
    for lens in (None, lengths):
        for dual in (None, 2.0):
            loss, m = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=2.0, lengths=lens, dual_clip=dual)
            ref = _reference(cur, prox, behav, adv, 0.2, 0.28, 2.0, lens, dual)
            assert float(loss) == pytest.approx(ref, rel=1e-5, abs=1e-7), (lens is None, dual)
            lw = (prox - behav).mean(1) / (1 if lens is None else lens.float().clamp(min=1))
            w = torch.exp(lw.clamp(max=math.log(2.0)))
            assert m["behav_log_ratio_mean"] == pytest.approx(float(lw.mean()), rel=1e-5)
            assert m["is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
            assert m["is_weight_min"] == pytest.approx(float(w.min()), rel=1e-5)
            assert m["is_weight_max"] == pytest.approx(float(w.max()), rel=1e-5)
            assert m["is_truncated_frac"] == pytest.approx(float((lw > math.log(2.0)).float().mean()))
    a = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=2.0)[0]
    b = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=2.0, dual_clip=2.0)[0]
    assert float(a) != float(b)  # the dual clip reaches ebpo_loss


def test_a_cap_of_exactly_one_is_allowed_and_truncates_only_above_it():
    prox = torch.tensor([[-3.0, -4.0], [-2.0, -2.0], [-5.0, -1.0]])
    behav = torch.tensor([[-3.0, -4.0], [-2.5, -2.5], [-4.0, -1.0]])  # log w = 0, 0.5, -0.5
    w, trunc = truncated_importance_weights(prox, behav, 1.0)
    assert trunc.tolist() == [False, True, False]  # exactly at the cap is not truncated
    assert w.tolist() == pytest.approx([1.0, 1.0, math.exp(-0.5)])
    for bad in (0.999, 0.0, -1.0):
        with pytest.raises(ValueError, match=rf"^truncated_importance_weights: cap must be >= 1, got {bad}$"):
            truncated_importance_weights(prox, behav, bad)
    lw, lt = truncated_importance_weights(prox, behav, 1.0, lengths=torch.tensor([1, 5, 1]))
    assert lt.tolist() == [False, True, False] and lw[2] == pytest.approx(math.exp(-0.5))
    assert float(torch.log(truncated_importance_weights(prox, behav, 3.0, torch.tensor([1, 5, 1]))[0][1])) == \
        pytest.approx(0.1)  # 0.5 / length 5


def test_decoupled_loss_matches_a_plain_reference_and_truncates():
    g = torch.Generator().manual_seed(0)
    B, N = 12, 3
    prox = torch.randn(B, N, generator=g) * 5 - 20
    behav = prox + torch.randn(B, N, generator=g) * 0.6  # some ratios above the cap
    cur = prox + torch.randn(B, N, generator=g) * 0.2
    adv = torch.randn(B, generator=g)
    for dual in (None, 3.0):
        loss, m = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=1.5, dual_clip=dual)
        assert float(loss) == pytest.approx(_reference(cur, prox, behav, adv, 0.2, 0.28, 1.5, dual_clip=dual), rel=1e-5)
    w, trunc = truncated_importance_weights(prox, behav, 1.5)
    lw = (prox - behav).mean(1)
    assert torch.equal(trunc, lw > math.log(1.5)) and 0 < int(trunc.sum()) < B
    assert float(w.max()) == pytest.approx(1.5) and m["is_truncated_frac"] == pytest.approx(float(trunc.float().mean()))
    assert m["is_weight_max"] == pytest.approx(1.5)


def test_weights_carry_no_gradient_and_scale_each_sequence():
    g = torch.Generator().manual_seed(1)
    prox = torch.randn(4, 2, generator=g)
    behav = prox - torch.tensor([[0.1], [0.0], [-0.2], [0.3]])
    cur = prox.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    loss, _ = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=10.0)
    loss.backward()
    w = torch.exp((prox - behav).mean(1))
    # at cur == prox (ratio 1, inside the clip window) d loss / d cur[i, n] = -w_i A_i / (B N)
    expected = (-(w * adv) / (4 * 2))[:, None].expand(4, 2)
    assert torch.allclose(cur.grad, expected, atol=1e-6)


def test_behaviour_equal_to_proximal_is_the_on_policy_loss_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    prox = torch.randn(6, 2, generator=g)
    cur = prox + 0.1 * torch.randn(6, 2, generator=g)
    adv = torch.randn(6, generator=g)
    a, ma = ebpo_loss(cur, prox, adv, 0.2, 0.28, dual_clip=3.0)
    b, mb = decoupled_ebpo_loss(cur, prox, prox.clone(), adv, 0.2, 0.28, cap=2.0, dual_clip=3.0)
    assert torch.equal(a, b) and mb["is_weight_min"] == mb["is_weight_max"] == 1.0
    assert all(ma[k] == mb[k] for k in ma)
