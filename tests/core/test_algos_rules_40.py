"""Rules of compute_advantages / kl_estimate that the formula tests leave open (issue 40): the defaults (grpo,
std_normalize, eps = 1e-6, k3 with its bound at K3_LINEAR_BELOW), the refusal of mismatched shapes, an empty
batch, RLOO on groups of two (the G/(G-1) factor where it is largest), std normalisation of a small spread
against a plain loop, and k3's tangent below -c."""
import math

import pytest
import torch

from ebpo.core.algos import K3_LINEAR_BELOW, compute_advantages, kl_estimate


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
