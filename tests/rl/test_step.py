"""One RL step (ebpo.rl.step): held-out correctness is decided by the judging rewards only; shaping rewards (judge:
false) shape training."""
import pytest

from ebpo.infra.config import build
from ebpo.rl.config import RLConfig
from ebpo.rl.step import solved as _solved


def test_shaping_reward_does_not_decide_correctness():
    right_answer_other_working = {"rewards": {"math": 1.0, "column_working": 0.5}}
    assert _solved(right_answer_other_working) == 0.0  # default: every reward must give full marks
    assert _solved(right_answer_other_working, ["math"]) == 1.0
    assert _solved({"rewards": {"math": 0.0, "column_working": 1.0}}, ["math"]) == 0.0
    # mixed data: a reward that skips the row (None) is ignored; no applicable judge = unsolved
    assert _solved({"rewards": {"math": None, "code": 1.0}}, ["math", "code"]) == 1.0
    assert _solved({"rewards": {"math": None, "column_working": 1.0}}, ["math"]) == 0.0


def test_recipe_needs_a_judging_reward():
    fns = [{"fn": "math", "judge": False}, {"fn": "format_boxed", "judge": False}]
    with pytest.raises(ValueError, match="judge"):
        build(RLConfig, {"reward": {"fns": fns}})
    cfg = build(RLConfig, {"reward": {"fns": [{"fn": "math"}, {"fn": "format_boxed", "judge": False}]}})
    assert [f.judge for f in cfg.reward.fns] == [True, False]
