"""The reward API (rewards/api.py): results normalised to (score, extras), specs of a recipe's rewards; and the
package's promise that a user's reward file needs nothing of ebpo but `rewards`."""
import os

import pytest

from rewards import RewardResult, RewardSpec, as_spec, normalize

HERE = os.path.dirname(os.path.abspath(__file__))


def test_normalize_and_specs():
    assert normalize(1, "r") == (1.0, {})
    assert normalize(None, "r") == (None, {})
    assert normalize(RewardResult(0.5, {"a": 1}), "r") == (0.5, {"a": 1})
    assert normalize({"score": 0.25, "why": "x"}, "r") == (0.25, {"why": "x"})
    with pytest.raises(TypeError, match="r returned str"):
        normalize("1", "r")
    with pytest.raises(ValueError, match="non-finite"):
        normalize(float("nan"), "r")
    assert as_spec(("math", 2.0, {"timeout_s": 3})) == RewardSpec("math", 2.0, {"timeout_s": 3}, "math")
    assert as_spec("pkg.mod:fn").name == "fn"
    with pytest.raises(ValueError, match="weight"):
        RewardSpec("math", float("inf"))
    with pytest.raises(ValueError, match="ref"):
        as_spec({"weight": 1})


def test_rewards_imports_nothing_else_of_ours():
    import subprocess
    import sys
    code = ("import sys, rewards, rewards.code_reward, rewards.math_reward; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ebpo', 'rollout', 'kernels')]; "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(HERE))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
