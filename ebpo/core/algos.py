"""Pure functions of the EBPO update: advantages, log-ratio, log-space clipped surrogate, KL estimators.

All tensors are per sequence; groups are the prompt groups of GRPO (samples of one prompt share a
`group_id`), never the device batch (docs/background.md section 7). No randomness, no state.
"""
from __future__ import annotations

import math

import torch

ADVANTAGE_METHODS = ("grpo", "rloo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, method: str = "grpo",
                       std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages (B,) fp32 from rewards (B,) and prompt-group ids (B,).

    grpo: A_i = r_i - mean_g(r); rloo: A_i = r_i - mean_{j in g, j != i} r_j = G/(G-1) (r_i - mean_g(r)).
    std_normalize: divide by the group's population std (unbiased=False) + eps. A group of one sample,
    or a group whose rewards are all equal, gets advantage 0. The single implementation the trainer calls.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"method: expected one of {ADVANTAGE_METHODS}, got {method!r}")
    r = rewards.double().flatten()
    g = group_ids.flatten()
    if g.shape != r.shape:
        raise ValueError(f"group_ids: shape {tuple(group_ids.shape)} does not match rewards {tuple(rewards.shape)}")
    _, inv = torch.unique(g, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    var = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inv, centred ** 2) / count
    if method == "rloo":
        G = count[inv]
        adv = torch.where(G > 1, centred * G / (G - 1).clamp(min=1), torch.zeros_like(centred))
    else:
        adv = centred
    if std_normalize:
        adv = adv / (var[inv].sqrt() + eps)
    return adv.float()


def log_ratio(cur: torch.Tensor, old: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Estimated log rho (B,) = (1/N) sum_n (C_n^cur - C_n^old); divided by `lengths` (B,) if given.

    cur, old: composites (B, N) of the same noise draws (w_n = 1/N).
    """
    lr = (cur - old).mean(dim=1)
    if lengths is not None:
        lr = lr / lengths.to(lr.dtype).clamp(min=1)
    return lr


def clipped_surrogate(log_rho: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip: float | None = None):
    """Per-sequence objective min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), computed in log space.

    log_rho, advantages: (B,). If A >= 0: log rho' = min(log rho, log(1+eps_high)), else
    log rho' = max(log rho, log(1-eps_low)); objective = exp(log rho') A. At a clipped sequence the
    gradient is 0, as in the textbook form.

    `dual_clip` = c > 1 (dual-clip PPO, Ye et al. 2020) also bounds the negative-advantage side from
    above: for A < 0 the objective is max(min(rho A, clip(rho) A), c A), i.e. log rho' <= log c. Without
    it a sequence whose likelihood rose a lot while A < 0 contributes rho A without bound (sequence-level
    ELBO ratios reach e^45 after one large step) and exp overflows past log rho = 88.
    Returns (objective (B,), clipped_low (B,) bool, clipped_high (B,) bool, clipped_dual (B,) bool).
    """
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low: must be in [0, 1), got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high: must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip: must be > 1 (or None), got {dual_clip}")
    hi = math.log1p(eps_high)
    lo = math.log1p(-eps_low)
    pos = advantages >= 0
    clipped_high = pos & (log_rho > hi)
    clipped_low = (~pos) & (log_rho < lo)
    clipped_dual = torch.zeros_like(pos)
    # torch.where (not clamp/min) so the unclipped branch keeps its full gradient at the boundary.
    lr_clipped = torch.where(clipped_high, torch.full_like(log_rho, hi),
                             torch.where(clipped_low, torch.full_like(log_rho, lo), log_rho))
    if dual_clip is not None:
        cap = math.log(dual_clip)
        clipped_dual = (~pos) & (log_rho > cap)
        lr_clipped = torch.where(clipped_dual, torch.full_like(log_rho, cap), lr_clipped)
    return lr_clipped.exp() * advantages, clipped_low, clipped_high, clipped_dual


# Below d = -K3_LINEAR_BELOW nats, k3 continues along its tangent (see `kl_estimate`).
K3_LINEAR_BELOW = 20.0


def kl_estimate(log_ratio_ref: torch.Tensor, estimator: str = "k3", linear_below: float = K3_LINEAR_BELOW) -> torch.Tensor:
    """Per-sequence KL(pi_theta || pi_ref) estimate (B,) from d = log pi_theta - log pi_ref (B,).

    k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d (non-negative, unbiased under samples of pi_theta).

    k3 is bounded: for d < -c (c = `linear_below`, default 20 nats) it continues along its tangent at -c,
    k3(-c) + (1 - e^c)(d + c), so value and slope are continuous, the value is finite for every finite d
    and the slope never exceeds e^c - 1 in size (the penalty still pulls towards the reference). Plain
    k3 overflows below d = -88 nats (exp(88) > the fp32 maximum), which a sequence-level ELBO log-ratio
    of a drifted reference reaches: the loss was inf and the gradient NaN. k1 and k2 need no bound.
    """
    if estimator == "k1":
        return log_ratio_ref
    if estimator == "k2":
        return 0.5 * log_ratio_ref ** 2
    if estimator == "k3":
        c = float(linear_below)
        inside = log_ratio_ref.clamp(min=-c)  # exp never sees d < -c, so neither value nor gradient overflows
        k3 = torch.expm1(-inside) + inside
        tangent = (math.expm1(c) - c) + (-math.expm1(c)) * (log_ratio_ref + c)
        return torch.where(log_ratio_ref < -c, tangent, k3)
    raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")


def ebpo_loss(cur: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
              lengths: torch.Tensor | None = None, ref: torch.Tensor | None = None, kl_beta: float = 0.0,
              kl_estimator: str = "k3", dual_clip: float | None = None,
              seq_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """EBPO loss (scalar) and metrics from composites of one minibatch.

    cur, old (and ref): (B, N) composites of the same draws; advantages (B,); lengths (B,) response
    lengths for length normalisation or None. loss = -mean_seq(clipped objective) + kl_beta * mean_seq(KL),
    a *sequence-level* mean (the ratio is per sequence). The KL uses the same (optional) length
    normalisation. `dual_clip`: see `clipped_surrogate`. `seq_weights` (B,) (no grad) multiplies each
    sequence's clipped objective: the truncated importance weights of the decoupled off-policy loss
    (`ebpo.core.offpolicy`); None leaves the on-policy loss untouched. Metrics are floats: pg_loss,
    clipfrac_low/high/dual, log_ratio_mean/max (|.|max), kl.
    """
    lr = log_ratio(cur, old.detach(), lengths)
    obj, c_lo, c_hi, c_dual = clipped_surrogate(lr, advantages.to(lr.dtype), eps_low, eps_high, dual_clip)
    pg_loss = -(obj if seq_weights is None else obj * seq_weights.detach().to(obj.dtype)).mean()
    loss = pg_loss
    kl_val = torch.zeros(())
    if ref is not None and kl_beta > 0:
        kl = kl_estimate(log_ratio(cur, ref.detach(), lengths), kl_estimator).mean()
        loss = loss + kl_beta * kl
        kl_val = kl.detach()
    elif ref is not None:
        kl_val = kl_estimate(log_ratio(cur.detach(), ref, lengths), kl_estimator).mean()
    metrics = {
        "pg_loss": float(pg_loss.detach()),
        "clipfrac_low": float(c_lo.float().mean()),
        "clipfrac_high": float(c_hi.float().mean()),
        "clipfrac_dual": float(c_dual.float().mean()),
        "log_ratio_mean": float(lr.detach().mean()),
        "log_ratio_max": float(lr.detach().abs().max()),
        "kl": float(kl_val),
    }
    return loss, metrics
