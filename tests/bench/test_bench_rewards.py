"""ebpo/bench/rewards.py: the reasoning-gym rows the benchmark scores are real rows, half answered right."""
import pytest

from ebpo.bench.rewards import _rg_samples


def test_rg_samples_are_half_right_by_the_reward_itself():
    rg = pytest.importorskip("reasoning_gym", reason="the envs extra")
    rows = _rg_samples(8, "basic_arithmetic,gcd")
    assert len(rows) == 8 and {r["metadata"]["source_dataset"] for r in rows} == {"basic_arithmetic", "gcd"}
    for k, r in enumerate(rows):  # the reference: reasoning-gym's own verifier on the same entries
        entry = {"question": r["prompt"], "answer": r["answer"], "metadata": r["metadata"]}
        pred = r["completion"].split("<answer>")[1].split("</answer>")[0]
        assert rg.get_score_answer_fn(r["metadata"]["source_dataset"])(pred, entry) == (1.0 if k % 4 in (0, 2) else 0.0)


def test_rg_samples_are_empty_without_reasoning_gym(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_rg(name, *a, **k):
        if name == "reasoning_gym":
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_rg)
    assert _rg_samples(4, "gcd") == []
