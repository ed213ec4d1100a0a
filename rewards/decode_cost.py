"""Built-in decoding-cost reward: -forwards / token of the rollout that produced the completion.

The RL trainer puts each rollout's decode trace into the sample's metadata as
``metadata["decode"] = {"forwards": F, "tokens": T}`` (model forwards the sequence took part in, generated
tokens up to and including EOS). The reward is ``-F / T`` (= -1 / TPF); its weight in the recipe is the
lambda of ``-lambda * forwards / token``. A shaping reward: give it ``judge: false``. Samples without a
trace (a dry run, a reward call outside the trainer) are skipped, not scored.
"""
from __future__ import annotations

from rewards.api import RewardResult, skip


def decode_cost(*, metadata: dict | None = None, **_) -> RewardResult:
    """-forwards / tokens of the sample's rollout (`metadata["decode"]`); skipped without a trace."""
    trace = (metadata or {}).get("decode")
    if not trace or not trace.get("tokens"):
        return skip("no decode trace in metadata['decode']")
    return RewardResult(-float(trace["forwards"]) / float(trace["tokens"]),
                        {"forwards": float(trace["forwards"]), "tokens": float(trace["tokens"])})
