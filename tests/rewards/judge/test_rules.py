"""The judge's pure rules, called directly (rewards/_judge.py, rewards/_judge_runner.py):

* an answer line means a plain value, the judge's own exception, or a failed call; everything not foreseen is a
  failed call (`bad_record`), never a pass; the outcome words are a fixed set or `raised:<identifier>`;
* stdio output is compared line by line after normalising line endings, trailing whitespace and trailing
  blank lines;
* test code is compiled once per source;
* a start message numbers the start and its prefetched call; self-contained tests (one prefetched call,
  nothing else of the candidate) are started ahead, in one write.
"""
import json

import pytest

from rewards import _judge as J
from rewards._plain import plain_encode
from tests.rewards.judge.channel import _call_spec


class _T:
    """The part of _judge._Test that interpret uses."""

    def __init__(self):
        self.failed = self.raised = None

    fail = J._Test.fail


def _interp(obj, expect="call", harness=False):
    t = _T()
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    try:
        return ("value", J.interpret(body, t, expect, harness)), t
    except J.CallFailed as e:
        return ("failed", str(e)), t
    except Exception as e:  # the judge's own exception class, raised for the test code
        return ("raised", type(e)), t


def test_interpret_plain_values_names_and_stdio_records():
    for v in (0, -3, 2.5, "x", [1, [2, "a"]], {"k": [1, 2]}, None, True, (1, 2), {1, 2}):
        (kind, got), t = _interp({"v": plain_encode(v)})
        assert kind == "value" and got == v and type(got) is type(v) and t.failed is None
    (kind, got), _ = _interp({"names": {"f": ["fn"]}}, "resolve")
    assert (kind, got) == ("value", {"f": ["fn"]})
    rec = {"stdout": "a\n", "exit": 0, "status": "ok"}
    assert _interp(rec, "stdio", harness=True)[0] == ("value", rec)
    # a value where a resolve is expected, names where a call is: not foreseen
    assert _interp({"v": plain_encode(1)}, "resolve")[0] == ("failed", "bad_record")
    assert _interp({"names": {}}, "call")[0] == ("failed", "bad_record")
    assert _interp({"names": ["f"]}, "resolve")[0] == ("failed", "bad_record")


def test_interpret_turns_everything_unforeseen_into_a_failed_call():
    for body in (b"not json", b"\xff\xfe", b"[" * 100000, b"[1, 2]", b'"v"', b"3", b"null", b"{}", b'{"x": 1}'):
        (kind, why), t = _interp(body)
        assert (kind, why) == ("failed", "bad_record") and t.failed == "bad_record", body[:20]
    assert _interp({"v": {"t": "no such tag"}})[0] == ("failed", "bad_value")
    assert _interp({"bad": "TypeError"})[0] == ("failed", "bad_value")
    assert _interp({"bad": "TypeError", "v": 1}, "resolve")[0] == ("failed", "bad_record")


def test_interpret_reads_harness_records_only_when_they_are_the_harness_s():
    for why in ("timeout", "died", "output_limit"):
        (kind, got), t = _interp({"h": why}, "call", harness=True)
        assert (kind, got) == ("failed", why) and t.failed == why
        # the same record written by the candidate is not the harness's word
        assert _interp({"h": why}, "call")[0] == ("failed", "bad_record")
    for rec in ({"h": "ok"}, {"h": "raised:x"}, {"stdout": 3, "exit": 0}, {"v": plain_encode(1)}):
        assert _interp(rec, "stdio", harness=True)[0] == ("failed", "bad_record"), rec
    # a stdio record where a call is expected is not a value
    assert _interp({"stdout": "x", "exit": 0}, "call", harness=True)[0] == ("failed", "bad_record")


def test_interpret_raised_names():
    # an Exception of the builtins, in a call: raised here with the judge's own class, for the test code
    for name in ("ValueError", "KeyError", "ZeroDivisionError", "Exception", "RecursionError"):
        (kind, cls), t = _interp({"raised": name})
        assert kind == "raised" and cls is getattr(__builtins__, name, None) or cls.__name__ == name
        assert t.raised == name and t.failed is None
    # not an Exception subclass of the builtins, or the iteration enders, or not a call: a failed call
    for name, expect in [("StopIteration", "call"), ("StopAsyncIteration", "call"), ("SystemExit", "call"),
                         ("KeyboardInterrupt", "call"), ("GeneratorExit", "call"), ("print", "call"),
                         ("MyOwnError", "call"), ("ValueError", "resolve"), ("StopIteration", "resolve")]:
        (kind, why), t = _interp({"raised": name}, expect)
        assert (kind, why) == ("failed", "raised:" + name) and t.raised == name, (name, expect)
    # a name that is not a short ASCII identifier is not a status anyone reads: a bad record
    for name in ("a" * 41, "Value Error", "ValueError\n", "Érreur", "1abc", "", 7, None, ["ValueError"]):
        (kind, why), t = _interp({"raised": name})
        assert (kind, why) == ("failed", "bad_record") and t.raised is None, name
    (kind, why), _ = _interp({"raised": "a" * 40})
    assert (kind, why) == ("failed", "raised:" + "a" * 40)


def _lines(text):
    """The documented normalisation, as a plain loop."""
    out = []
    for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        out.append(ln.rstrip())
    while out and out[-1] == "":
        out.pop()
    return out


@pytest.mark.parametrize("text", ["", "\n", "a", "a\n", "  a  \n\n b\t\r\n\r\n", "x\r\ry\r", " \n \n", "a\n\nb\n\n\n",
                                  "\ta\n  \n", "a \r\n b \r\n"])
def test_normalize_output_is_the_documented_line_rule(text):
    assert J._normalize_output(text) == _lines(text)


def test_compiled_once_per_source():
    from rewards import _judge_runner as R
    R._CODE.clear()
    a = R.compiled_test("x = 1", "<a>")
    assert R.compiled_test("x = 1", "<other label>") is a and a.co_filename == "<a>"
    b = R.compiled_test("x = 2", "<b>")
    assert b is not a and b.co_filename == "<b>" and len(R._CODE) == 2
    R._CODE.clear()


class _Ch:
    def __init__(self, seq=0):
        self.seq, self.test_timeout, self.sent = seq, 1.5, []

    def send_many(self, msgs):
        self.sent.append(list(msgs))


def test_start_message_numbers_the_start_and_its_prefetched_call():
    ch = _Ch(seq=4)
    spec = {"i": 3, "budget": 0.5, "names": ["f", "g"]}
    msg, pre = J.start_message(ch, spec)
    assert msg == {"op": "start", "seq": 5, "i": 3, "kind": "call", "budget": 0.5, "names": ["f", "g"]}
    assert pre is None and ch.seq == 5
    first = {"name": "f", "args": plain_encode([1, "a"]), "kwargs": plain_encode({"k": 2})}
    msg, pre = J.start_message(ch, dict(spec, first=first))
    assert msg["seq"] == 6 and ch.seq == 7
    assert msg["first"] == {"op": "call", "seq": 7, "name": "f", "args": first["args"], "kwargs": first["kwargs"]}
    assert pre == (("f", json.dumps(first["args"]), json.dumps(first["kwargs"])), 7)


def test_self_contained_is_one_prefetched_call_and_nothing_else():
    assert J._self_contained(_call_spec(["f"], "f"))
    assert not J._self_contained(_call_spec(["f"]))  # no prefetched call
    assert not J._self_contained(_call_spec(["f", "g"], "f"))  # uses another name too
    assert not J._self_contained(_call_spec(["g"], "f"))
    assert not J._self_contained(dict(_call_spec(["f"], "f"), kind="stdio"))


def test_send_ahead_starts_the_run_of_self_contained_tests_in_one_write():
    tests = [_call_spec(["f"]), _call_spec(["f"], "f"), _call_spec(["g"], "g"), _call_spec(["f", "g"], "f"),
             _call_spec(["f"], "f")]
    ch = _Ch()
    assert J._send_ahead(ch, tests, 0) == 0 and ch.sent == []
    n = J._send_ahead(ch, tests, 1)
    assert n == 2 and len(ch.sent) == 1 and [m["i"] for m in ch.sent[0]] == [1, 2]
    assert all(m["budget"] == 1.5 and m["op"] == "start" for m in ch.sent[0])
    assert [m["seq"] for m in ch.sent[0]] == [1, 3] and ch.seq == 4  # each start and its call numbered
    assert tests[1]["sent"] == (1, (("f", json.dumps(plain_encode([1])), json.dumps(plain_encode({}))), 2))
    assert tests[2]["sent"][0] == 3 and "sent" not in tests[0] and "sent" not in tests[3]
    assert J._send_ahead(ch, tests, 4) == 1 and [m["i"] for m in ch.sent[1]] == [4]
    assert J._send_ahead(ch, tests, 5) == 0
