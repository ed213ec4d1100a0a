"""RewardWorker: weights, skips, hung/raising/crashing rewards, batched and async rewards, dry runs."""
import os
import time

import pytest

import rewards.sandbox as sandbox
from rewards import RewardLoadError, RewardSpec, RewardWorker

USER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_user_rewards.py")


def _s(completion, answer=None, tests=None):
    return {"prompt": "p", "completion": completion, "answer": answer, "tests": tests, "metadata": {}}


@pytest.fixture(scope="module")
def worker():
    w = RewardWorker([RewardSpec(f"{USER}:sleep_forever", 1.0, name="sleepy"),
                      RewardSpec(f"{USER}:raise_on_bad", 0.5, name="raiser"),
                      RewardSpec(f"{USER}:die_on_bad", 0.25, name="dier")],
                     num_workers=2, timeout_s=1.5, default_score=-1.0)
    yield w
    w.close()


def test_hung_raising_and_crashing_calls_cost_only_themselves(worker):
    worker.stats(reset=True)
    samples = [_s("ok"), _s("hang"), _s("bad"), _s("ok")]
    t0 = time.monotonic()
    out = worker.score(samples)
    elapsed = time.monotonic() - t0
    # One hung call costs its 1.5 s timeout on one worker while the other worker keeps going.
    assert elapsed < 1.5 + 2.0, elapsed
    assert [r["score"] for r in out] == [1.75, -1.0 + 0.5 + 0.25, 1.0 - 0.5 - 0.25, 1.75]
    assert out[1]["timeout"] and not out[1]["error"]
    assert out[2]["error"] and not out[2]["timeout"]
    assert out[1]["rewards"] == {"sleepy": -1.0, "raiser": 1.0, "dier": 1.0}
    assert "boom" in out[2]["extras"]["raiser"]["error"]
    assert "died" in out[2]["extras"]["dier"]["error"]
    stats = worker.stats()
    assert stats["reward/timeouts"] == 1 and stats["reward/errors"] == 2
    assert stats["reward/worker_restarts"] == 2
    # the pool keeps working after the kills
    assert [r["score"] for r in worker.score([_s("ok")] * 3)] == [1.75] * 3
    assert worker.stats(reset=True)["reward/calls"] == 21
    assert worker.stats()["reward/calls"] == 0


def test_weights_builtins_batched_async_and_skips():
    specs = [("math", 1.0, {}), ("format_boxed", 0.1, {}), (f"{USER}:batched_len", 0.01, {}),
             {"ref": f"{USER}:async_reward", "weight": 2.0, "kwargs": {"scale": 0.5}}]
    with RewardWorker(specs, num_workers=2, timeout_s=10) as w:
        out = w.score([_s("so \\boxed{160}", "160"), _s("161", "160"), _s("x", None)])
        stats = w.stats()
    lens = [len("so \\boxed{160}"), 3, 1]
    assert out[0]["score"] == pytest.approx(1.0 + 0.1 + 0.01 * lens[0])
    assert out[1]["score"] == pytest.approx(0.01 * lens[1])
    assert out[2]["rewards"]["math"] is None and out[2]["skipped"]  # no gold answer: skip
    assert out[2]["score"] == pytest.approx(0.01 * lens[2])
    assert out[0]["extras"]["async_reward"] == {"seen": "so \\boxed{160}"}
    assert stats["reward/skips"] == 1 and stats["reward/errors"] == 0


def test_code_reward_through_the_pool_reports_sandbox_mode():
    with RewardWorker([("code", 1.0, {"test_timeout_s": 1.0, "total_timeout_s": 4.0})],
                      num_workers=2, timeout_s=10) as w:
        out = w.score([_s("```python\ndef add(a, b):\n    return a + b\n```", tests=["assert add(1, 2) == 3"]),
                       _s("def add(a, b):\n    return a - b", tests=["assert add(1, 2) == 3"])])
        assert [r["score"] for r in out] == [1.0, 0.0]
        assert w.stats()["sandbox/mode"] == out[0]["extras"]["code"]["sandbox"]


def test_dry_run_and_construction_errors_are_clear():
    with pytest.raises(RewardLoadError, match="no attribute 'nope'"):
        RewardWorker([f"{USER}:nope"], num_workers=0)
    with pytest.raises(RewardLoadError, match=r"kwargs \['bogus'\] are not parameters"):
        RewardWorker([(f"{USER}:wrong_type", 1.0, {"bogus": 1})], num_workers=0)
    with pytest.raises(RewardLoadError, match="required parameter 'rubric'"):
        RewardWorker([f"{USER}:needs_unknown"], num_workers=0)
    with pytest.raises(ValueError, match="unique"):
        RewardWorker(["format_boxed", "format_boxed"], num_workers=0)
    w = RewardWorker([f"{USER}:wrong_type"], num_workers=0)
    with pytest.raises(RewardLoadError, match="wrong_type.*returned str"):
        w.dry_run({"prompt": "What is 1+1?", "answer": "2"})
    ok = RewardWorker(["math"], num_workers=0).dry_run({"prompt": "q", "answer": "2", "completion": "2"})
    assert ok["score"] == 1.0


def test_auto_mode_falls_back_without_bwrap(monkeypatch):
    monkeypatch.setattr(sandbox, "mode_works", lambda m: m == "unshare")
    assert sandbox.resolve_mode("auto").mode == "unshare"
    monkeypatch.setattr(sandbox, "mode_works", lambda m: m == "rlimits")
    assert sandbox.resolve_mode("auto").mode == "rlimits"
    with pytest.raises(sandbox.SandboxError):
        sandbox.resolve_mode("bwrap")
    monkeypatch.setattr(sandbox, "mode_works", lambda m: False)  # even rlimits cannot run the harness
    with pytest.raises(sandbox.SandboxError, match="does not work"):
        sandbox.resolve_mode("auto")
