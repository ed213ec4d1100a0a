"""ebpo rewards: reward API, loader, built-ins (math, code, format) and the hard-timeout RewardWorker.

Imports nothing else of ebpo, so a user's reward file needs only this package. See docs/rewards.md.
"""
from rewards.api import RewardResult, RewardSpec, as_spec, batched, normalize, skip
from rewards.code_reward import check_timeout_budget, total_budget_s
from rewards.code_tests import audit_tests
from rewards.loader import BUILTINS, RewardLoadError, call_reward, check_signature, load_reward
from rewards.worker import COUNTERS, RewardWorker

__all__ = ["RewardResult", "RewardSpec", "as_spec", "batched", "normalize", "skip", "BUILTINS",
           "RewardLoadError", "call_reward", "check_signature", "load_reward", "COUNTERS", "RewardWorker",
           "check_timeout_budget", "total_budget_s", "audit_tests"]
