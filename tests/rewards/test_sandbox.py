"""rewards/sandbox.py, the parent's side of a sample: what it accepts on the verdict socket."""
import json
import os

from rewards.sandbox import Limits, _Session


def _feed(session, objs):
    for obj in objs:
        session._verdict(json.dumps(obj).encode() if not isinstance(obj, bytes) else obj)


def test_verdicts_are_taken_once_each_in_order_and_done_only_after_the_last():
    s = _Session(None, b"", Limits(), 3, None)
    _feed(s, [{"i": 0, "ok": True, "why": "ok"}, {"done": 1},  # before the writer's pid: not the protocol
              {"pid": os.getpid()}, {"pid": 1},
              {"done": 1}, {"i": 1, "ok": True, "why": "ok"}, {"i": 2, "ok": True, "why": "ok"},  # out of order
              {"i": 0, "ok": False, "why": "assert_failed"}, {"i": 0, "ok": True, "why": "ok"},  # a second for 0
              {"i": 1, "ok": "yes", "why": "ok"}, {"i": 1, "ok": True}, b"not json", [1, 2],  # malformed
              {"i": 1, "ok": True, "why": "ok"}, {"done": 1}, {"i": 2, "ok": False, "why": "timeout"}])
    assert not s.judged  # `done` before the last verdict was not taken
    assert s.verdicts == [(False, "assert_failed"), (True, "ok"), (False, "timeout")]
    _feed(s, [{"i": 3, "ok": True, "why": "ok"}, {"done": 1}])
    assert s.judged and s.verdicts == [(False, "assert_failed"), (True, "ok"), (False, "timeout")]
    os.close(s.judge_pidfd)


def test_an_infrastructure_error_from_the_judge_is_not_a_verdict():
    s = _Session(None, b"", Limits(), 2, None)
    _feed(s, [{"pid": os.getpid()}, {"error": "the test runner could not be confined: EPERM"}])
    assert s.judged and s.infra_error.startswith("the test runner") and s.verdicts == [None, None]
    os.close(s.judge_pidfd)
