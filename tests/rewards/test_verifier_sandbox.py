"""rewards/verifier_sandbox.py: what the parent takes from the verifier server, and a server that dies."""
import math
import os
import signal

import pytest

from rewards import verifier_sandbox as vs


def test_the_parent_takes_a_finite_score_in_range_and_numeric_metrics_only():
    ok = vs.parse_reply({"status": "ok", "out": '{"score": 0.25, "metrics": {"a": 1, "b": "x", "c": true, "d": NaN}}'})
    assert ok == {"score": 0.25, "metrics": {"a": 1.0}}
    for out in ('{"score": NaN}', '{"score": 1.5}', '{"score": -0.1}', '{"score": "1.0"}', '{"score": true}',
                '[1.0]', "1.0", "not json", '{"score": Infinity}', "", None):
        got = vs.parse_reply({"status": "ok", "out": out})
        assert set(got) == {"error"}, out
    assert vs.parse_reply({"status": "ok", "out": '{"error": "' + "x" * 1000 + '"}'}) == {"error": "x" * 300}
    for status in ("timeout", "died", "not_confined", "???"):
        assert set(vs.parse_reply({"status": status, "out": '{"score": 1.0}'})) == {"error"}
    assert vs.parse_reply({"status": "skip", "out": "no such task"}) == {"skip": "no such task"}
    assert not math.isnan(vs.parse_reply({"status": "ok", "out": '{"score": 1}'})["score"])


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="auto, namespaces, chroot, none"):
        vs.score("rg", {}, gold="1", mode="bwrap")


def test_a_server_that_dies_is_replaced_for_the_next_answer():
    pytest.importorskip("reasoning_gym", reason="the envs extra")
    from ebpo.infra.data import load_rows
    from rewards.reasoning_gym_reward import reasoning_gym_score
    vs.close()
    row = load_rows("rg:gcd?size=1&seed=3")[0]

    def right():
        return reasoning_gym_score(completion=f"<answer>{row['answer']}</answer>", answer=row["answer"],
                                   metadata=row["metadata"]).score
    try:
        assert right() == 1.0
        first = vs._STATE["server"].proc.pid
        os.kill(first, signal.SIGKILL)
        assert right() == 1.0 and vs._STATE["server"].proc.pid != first
    finally:
        vs.close()
