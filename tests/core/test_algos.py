"""Advantages, clipped surrogate and KL estimators (ebpo.core.algos) against plain textbook formulas.

Also the rules the formulas leave open: the defaults (grpo, std_normalize, eps = 1e-6, k3 with its bound at
K3_LINEAR_BELOW), the refusal of mismatched shapes, an empty batch, RLOO on groups of two (the G/(G-1) factor where
it is largest), std normalisation of a small spread against a plain loop, and k3's tangent below -c."""
import math

import pytest
import torch

from ebpo.core.algos import K3_LINEAR_BELOW, clipped_surrogate, compute_advantages, ebpo_loss, kl_estimate, log_ratio


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


def _plain(rewards, groups, method, std_normalize, eps=1e-6):
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        mine = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(mine) / len(mine)
        if method == "rloo":
            others = [x for j, (x, h) in enumerate(zip(rewards, groups)) if h == g and j != i]
            a = r - sum(others) / len(others) if others else 0.0
        else:
            a = r - mean
        if std_normalize:
            a = a / (math.sqrt(sum((x - mean) ** 2 for x in mine) / len(mine)) + eps)
        out.append(a)
    return out


@pytest.mark.parametrize("method", ["grpo", "rloo"])
@pytest.mark.parametrize("std_normalize", [True, False])
def test_groups_of_two_and_small_spreads_match_a_plain_loop(method, std_normalize):
    # groups of 2 (RLOO's G/(G-1) = 2), a singleton, an all-equal group, spreads down to 1e-4 (std ~ eps * 50)
    rewards = [0.0, 1.0, 0.3, 0.3001, 5.0, 2.0, 2.0, 2.0, 1e-4, 3e-4, 0.0]
    groups = [7, 7, 3, 3, 9, 1, 1, 1, 4, 4, 4]
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), method,
                             std_normalize).tolist()
    want = _plain(rewards, groups, method, std_normalize)
    for g, w in zip(got, want):  # fp64 inside, one fp32 rounding at the end
        assert abs(g - w) <= 2e-7 * max(1.0, abs(w)), (got, want)


def test_defaults_are_grpo_std_normalised_with_eps_1e_6():
    r, g = torch.tensor([0.0, 1e-5, 3e-5, 1.0, 0.0]), torch.tensor([0, 0, 0, 1, 1])
    assert torch.equal(compute_advantages(r, g), compute_advantages(r, g, "grpo", True, 1e-6))
    assert not torch.equal(compute_advantages(r, g), compute_advantages(r, g, "grpo", True, 1e-3))
    assert not torch.equal(compute_advantages(r, g), compute_advantages(r, g, "rloo", True, 1e-6))


def test_mismatched_shapes_are_refused_naming_both_and_an_empty_batch_is_empty():
    with pytest.raises(ValueError, match=r"^group_ids: shape \(3,\) does not match rewards \(4,\)$"):
        compute_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^group_ids: shape \(2, 2\) does not match rewards \(3,\)$"):
        compute_advantages(torch.zeros(3), torch.zeros(2, 2, dtype=torch.long))
    for method in ("grpo", "rloo"):
        out = compute_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), method)
        assert out.shape == (0,) and out.dtype == torch.float32


def test_k3_defaults_and_its_tangent_below_minus_c():
    d = torch.tensor([-300.0, -25.0, -20.0, -5.0, 0.0, 3.0], dtype=torch.float64)
    assert torch.equal(kl_estimate(d), kl_estimate(d, "k3", K3_LINEAR_BELOW))
    for c in (1.0, 2.5, K3_LINEAR_BELOW):
        x = torch.tensor([-c - 3.0, -c - 0.5, -c + 0.5, 0.7], dtype=torch.float64)
        got = kl_estimate(x, "k3", c).tolist()
        k3 = lambda v: math.expm1(-v) + v  # noqa: E731
        want = [k3(-c) + (1 - math.exp(c)) * (v + c) if v < -c else k3(v) for v in x.tolist()]
        for gv, wv in zip(got, want):
            assert abs(gv - wv) <= 1e-12 * max(1.0, abs(wv)), (c, got, want)


def _plain_ebpo(cur, old, adv, eps_low, eps_high, lengths, ref, kl_beta, dual_clip, seq_weights, est="k3"):
    """ebpo_loss's docstring read per sequence, in Python floats."""
    B, N = len(cur), len(cur[0])
    lr = [sum(cur[i][n] - old[i][n] for n in range(N)) / N / (max(lengths[i], 1) if lengths else 1) for i in range(B)]
    objs, lo_f, hi_f, du_f = [], [], [], []
    for i in range(B):
        x, a = lr[i], adv[i]
        hi, lo = math.log1p(eps_high), math.log1p(-eps_low)
        c_hi, c_lo = a >= 0 and x > hi, a < 0 and x < lo
        y = hi if c_hi else lo if c_lo else x
        c_du = dual_clip is not None and a < 0 and x > math.log(dual_clip)
        y = math.log(dual_clip) if c_du else y
        objs.append(math.exp(y) * a * (seq_weights[i] if seq_weights else 1.0))
        lo_f.append(c_lo)
        hi_f.append(c_hi)
        du_f.append(c_du)
    pg = -sum(objs) / B
    kl = 0.0
    if ref is not None:
        d = [sum(cur[i][n] - ref[i][n] for n in range(N)) / N / (max(lengths[i], 1) if lengths else 1)
             for i in range(B)]
        kl = sum(math.expm1(-v) + v if est == "k3" else 0.5 * v * v for v in d) / B  # no d below -20 here
    loss = pg + (kl_beta * kl if ref is not None and kl_beta > 0 else 0.0)
    return loss, {"pg_loss": pg, "clipfrac_low": sum(lo_f) / B, "clipfrac_high": sum(hi_f) / B,
                  "clipfrac_dual": sum(du_f) / B, "log_ratio_mean": sum(lr) / B,
                  "log_ratio_max": max(abs(v) for v in lr), "kl": kl}


def test_ebpo_loss_and_metrics_match_a_plain_per_sequence_reading():
    from ebpo.core.algos import ebpo_loss
    g = torch.Generator().manual_seed(0)
    B, N = 10, 3
    old = torch.randn(B, N, generator=g, dtype=torch.float64) * 3
    cur = old + torch.randn(B, N, generator=g, dtype=torch.float64) * 1.5
    ref = old + torch.randn(B, N, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 0.0, -2.0, 1.5, -1.0, 0.3], dtype=torch.float64)
    lengths = torch.tensor([1, 0, 3, 1, 2, 5, 1, 4, 1, 2])
    weights = torch.rand(B, generator=g, dtype=torch.float64) * 2
    cases = [dict(), dict(lengths=lengths), dict(ref=ref), dict(ref=ref, kl_beta=0.3),
             dict(ref=ref, kl_beta=0.3, lengths=lengths), dict(dual_clip=1.5), dict(seq_weights=weights),
             dict(lengths=lengths, ref=ref, kl_beta=0.7, dual_clip=2.0, seq_weights=weights),
             dict(ref=ref, lengths=lengths), dict(ref=ref, kl_estimator="k2"), dict(ref=ref, kl_beta=0.4, kl_estimator="k2"),
             dict(kl_beta=0.5)]  # without ref, kl_beta adds nothing
    seen = dict.fromkeys(["clipfrac_low", "clipfrac_high", "clipfrac_dual"], 0.0)
    for kw in cases:
        loss, m = ebpo_loss(cur, old, adv, 0.2, 0.28, **kw)
        for k in seen:
            seen[k] += m[k]
        want_loss, want = _plain_ebpo(
            cur.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28,
            lengths.tolist() if "lengths" in kw else None, ref.tolist() if "ref" in kw else None,
            kw.get("kl_beta", 0.0), kw.get("dual_clip"), weights.tolist() if "seq_weights" in kw else None,
            kw.get("kl_estimator", "k3"))
        assert set(m) == set(want), kw
        for k, v in want.items():  # fp64 values; the clip fractions are fp32 means (one rounding)
            tol = 1e-7 if k.startswith("clipfrac") else 1e-9 * max(1.0, abs(v))
            assert abs(m[k] - v) <= tol, (kw, k, m[k], v)
        assert abs(float(loss) - want_loss) <= 1e-9 * max(1.0, abs(want_loss)), kw
    assert all(v > 0 for v in seen.values()), seen  # every clip exercised by some case


def test_clip_bounds_and_messages():
    from ebpo.core.algos import clipped_surrogate
    x, a = torch.zeros(2), torch.tensor([1.0, -1.0])
    for lo, hi, dual in [(0.0, 0.0, None), (0.999, 5.0, 1.0001), (0.2, 0.2, 1.5)]:
        clipped_surrogate(x, a, lo, hi, dual)
    for lo, hi, dual, msg in [(1.0, 0.2, None, r"eps_low: must be in \[0, 1\), got 1.0"),
                              (1.5, 0.2, None, r"eps_low: must be in \[0, 1\), got 1.5"),
                              (-0.1, 0.2, None, r"eps_low: must be in \[0, 1\), got -0.1"),
                              (0.2, -1e-9, None, r"eps_high: must be >= 0, got -1e-09"),
                              (0.2, 0.2, 1.0, r"dual_clip: must be > 1 \(or None\), got 1.0")]:
        with pytest.raises(ValueError, match="^" + msg + "$"):
            clipped_surrogate(x, a, lo, hi, dual)
