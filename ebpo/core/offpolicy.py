"""Decoupled off-policy EBPO for asynchronous RL: pure torch, no Ray, no I/O.

With bounded staleness the policy that sampled a sequence (the *behaviour* policy, weight version v_b)
is older than the policy the learner starts its update from (the *proximal* policy, the learner's
pre-update weights). The decoupled objective (AReaL's decoupled PPO, on block-ELBO composites):

    J = mean_i  w_i * min( rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i )
    rho_i = pi_theta(y_i) / pi_prox(y_i)                      (clipped: the trust region is the proximal)
    w_i   = min( pi_prox(y_i) / pi_behav(y_i), cap )          (truncated importance weight, no gradient)

Every likelihood is the block-ELBO composite of the same noise draws (B, N): log-ratios are means over the
draws of composite differences (`ebpo.core.algos.log_ratio`), so the shared noise cancels in each ratio.
When behaviour == proximal (a fresh sample, or a frozen policy) w_i = exp(0) = 1 exactly and the loss is
the on-policy EBPO loss bit for bit.
"""
from __future__ import annotations

import math

import torch

from ebpo.core.algos import ebpo_loss, log_ratio


def truncated_importance_weights(prox: torch.Tensor, behav: torch.Tensor, cap: float,
                                 lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence truncated importance weights behaviour -> proximal, and which were truncated.

    prox, behav: (B, N) composites (nats) of the same draws; cap >= 1; lengths (B,) or None: the same
    optional length normalisation as the clipped ratio. Returns (weights (B,) fp32 in (0, cap], detached;
    truncated (B,) bool, True where pi_prox / pi_behav > cap). The weight is computed in log space
    (min(log w, log cap), then exp) so a large log-ratio never overflows.
    """
    if cap < 1:
        raise ValueError(f"truncated_importance_weights: cap must be >= 1, got {cap}")
    lw = log_ratio(prox.detach(), behav.detach(), lengths)
    log_cap = math.log(cap)
    return torch.exp(lw.clamp(max=log_cap)), lw > log_cap


def decoupled_ebpo_loss(cur: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, advantages: torch.Tensor,
                        eps_low: float, eps_high: float, cap: float, lengths: torch.Tensor | None = None,
                        **ebpo_kwargs) -> tuple[torch.Tensor, dict]:
    """The decoupled EBPO loss (scalar) and metrics of one minibatch.

    cur (B, N) composites with grad; prox, behav (B, N) without; advantages (B,). `ebpo_kwargs` go to
    `ebpo_loss` (ref, kl_beta, kl_estimator, dual_clip); the KL term is not importance-weighted (it is a
    penalty on the current policy, not an estimate under the behaviour policy). Metrics: those of
    `ebpo_loss` plus is_weight_{mean,min,max} (after truncation), is_truncated_frac and behav_log_ratio_mean
    (mean log pi_prox/pi_behav before truncation).
    """
    weights, truncated = truncated_importance_weights(prox, behav, cap, lengths)
    loss, metrics = ebpo_loss(cur, prox, advantages, eps_low, eps_high, lengths=lengths, seq_weights=weights,
                              **ebpo_kwargs)
    metrics.update({
        "is_weight_mean": float(weights.mean()),
        "is_weight_min": float(weights.min()),
        "is_weight_max": float(weights.max()),
        "is_truncated_frac": float(truncated.float().mean()),
        "behav_log_ratio_mean": float(log_ratio(prox.detach(), behav.detach(), lengths).mean()),
    })
    return loss, metrics
