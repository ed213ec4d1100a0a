"""Advantages, clipped surrogate and KL estimators against plain textbook formulas."""
import math

import pytest
import torch

from ebpo.core.algos import clipped_surrogate, compute_advantages, ebpo_loss, kl_estimate, log_ratio


def plain_advantages(rewards, groups, method, std_normalize, eps):
    out = []
    for i, r in enumerate(rewards):
        same = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(same) / len(same)
        std = math.sqrt(sum((x - mean) ** 2 for x in same) / len(same))
        if method == "grpo":
            a = r - mean
        else:
            others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
            a = r - sum(others) / len(others) if others else 0.0
        out.append(a / (std + eps) if std_normalize else a)
    return out


@pytest.mark.parametrize("method", ["grpo", "rloo"])
@pytest.mark.parametrize("std_normalize", [True, False])
def test_advantages_per_group_match_plain_loop(method, std_normalize):
    rewards = [1.0, 0.0, 0.5, 2.0, 2.0, 0.3, -1.0, 4.0, 7.0]
    groups = [3, 3, 3, 0, 0, 9, 5, 5, 5]  # interleaved ids, a singleton group and a zero-std group
    got = compute_advantages(torch.tensor(rewards), torch.tensor(groups), method=method,
                             std_normalize=std_normalize, eps=1e-6)
    want = plain_advantages(rewards, groups, method, std_normalize, 1e-6)
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)
    assert got[5] == 0 and got[3] == 0 and got[4] == 0


def test_advantages_reject_unknown_method():
    with pytest.raises(ValueError, match="method"):
        compute_advantages(torch.ones(2), torch.zeros(2), method="ppo")


def textbook(rho, adv, el, eh):
    return torch.minimum(rho * adv, torch.clamp(rho, 1 - el, 1 + eh) * adv)


def test_log_space_clip_equals_textbook_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    lr = (torch.randn(400, generator=g) * 0.5).double()
    adv = torch.randn(400, generator=g).double()
    el, eh = 0.2, 0.28
    a = lr.clone().requires_grad_(True)
    b = lr.clone().requires_grad_(True)
    ours, c_lo, c_hi, c_dual = clipped_surrogate(a, adv, el, eh)
    ref = textbook(b.exp(), adv, el, eh)
    assert torch.allclose(ours, ref, atol=1e-12)
    ours.sum().backward()
    ref.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12)
    # Clip flags mark exactly the sequences whose textbook gradient vanished.
    assert torch.equal(c_lo | c_hi, b.grad == 0)
    assert c_lo.any() and c_hi.any() and not (c_lo & c_hi).any() and not c_dual.any()


def test_clip_never_overflows():
    obj, _, c_hi, _ = clipped_surrogate(torch.tensor([1e4, -1e4]), torch.tensor([1.0, -1.0]), 0.2, 0.2)
    assert torch.isfinite(obj).all() and bool(c_hi[0])
    # A < 0 with a huge ratio: unbounded (and overflowing) without the dual clip, c * A with it.
    lr = torch.tensor([200.0], requires_grad=True)
    obj, _, _, c_dual = clipped_surrogate(lr, torch.tensor([-2.0]), 0.2, 0.2, dual_clip=3.0)
    obj.sum().backward()
    assert obj.item() == pytest.approx(-6.0) and bool(c_dual[0]) and lr.grad.item() == 0.0
    assert not torch.isfinite(clipped_surrogate(torch.tensor([200.0]), torch.tensor([-2.0]), 0.2, 0.2)[0]).all()


def test_dual_clip_equals_textbook_value_and_gradient():
    """max(min(rho A, clip(rho) A), c A) for A < 0, the plain clip for A >= 0 (Ye et al. 2020)."""
    g = torch.Generator().manual_seed(5)
    lr = (torch.randn(600, generator=g) * 1.5).double()
    adv = torch.randn(600, generator=g).double()
    el, eh, c = 0.2, 0.28, 3.0
    a = lr.clone().requires_grad_(True)
    b = lr.clone().requires_grad_(True)
    ours, c_lo, c_hi, c_dual = clipped_surrogate(a, adv, el, eh, dual_clip=c)
    plain = textbook(b.exp(), adv, el, eh)
    ref = torch.where(adv < 0, torch.maximum(plain, c * adv), plain)
    assert torch.allclose(ours, ref, atol=1e-12)
    ours.sum().backward()
    ref.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12)
    assert torch.equal(c_lo | c_hi | c_dual, b.grad == 0)
    assert c_dual.any() and not (c_dual & (c_lo | c_hi)).any()
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(a, adv, el, eh, dual_clip=1.0)


def test_log_ratio_mean_over_draws_and_length_normalisation():
    cur = torch.tensor([[1.0, 3.0], [0.0, 4.0]])
    old = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    assert torch.allclose(log_ratio(cur, old), torch.tensor([2.0, 1.0]))
    assert torch.allclose(log_ratio(cur, old, torch.tensor([4.0, 2.0])), torch.tensor([0.5, 0.5]))


def test_kl_estimators_match_formulas():
    d = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    assert torch.allclose(kl_estimate(d, "k1"), d)
    assert torch.allclose(kl_estimate(d, "k2"), 0.5 * d * d)
    r = torch.exp(-d)  # pi_ref / pi_theta
    assert torch.allclose(kl_estimate(d, "k3"), r - 1 - torch.log(r))
    assert (kl_estimate(d, "k3") >= 0).all()
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(d, "k4")


def test_kl_penalty_enters_loss_only_when_beta_positive():
    g = torch.Generator().manual_seed(2)
    cur, old, ref = (torch.randn(5, 3, generator=g) for _ in range(3))
    adv = torch.randn(5, generator=g)
    l0, m0 = ebpo_loss(cur, old, adv, 0.2, 0.2, ref=ref, kl_beta=0.0)
    l1, m1 = ebpo_loss(cur, old, adv, 0.2, 0.2, ref=ref, kl_beta=0.5, kl_estimator="k2")
    kl = (0.5 * (cur - ref).mean(1) ** 2).mean()
    assert torch.allclose(l1 - l0, 0.5 * kl, atol=1e-6)
    assert m1["kl"] == pytest.approx(float(kl), rel=1e-5)
