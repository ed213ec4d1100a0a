"""Rules of rewards/_judge.py that its first mutation run (issue 40, docs/mutation/judge.md) found unpinned,
each driven through `judge_sample` by the plain harness of test_judge_inprocess_40.py (the channel protocol of
rewards/_harness.py's docstring), or by a variant of it that breaks one rule of that protocol on purpose.

* a name the candidate reports as a value that is not plain data fails the test (`bad_value`); a name it does
  not report is unbound even when the prompt's helpers define it;
* test code runs as module `__judge__`; prompt helpers and tests carry their labels (tracebacks name them);
* the exception a candidate's raise becomes says where it came from; an assert that fails after the test code
  caught the candidate's exception still names that exception;
* a stdio start carries the test's index and budget; a harness status is cut to 40 characters, a verdict's why
  to 60; a capture test that did not run has the empty string as its value;
* a test's deadline repeats quickly after test code catches it (the test is over in about its timeout);
* the harness's records are read up to max_output_bytes + 4096 bytes a line, one byte more is `output_limit`;
  the test after it still reads its own answers; a channel closed by the harness is `died`;
* requests are numbered afresh: a stale answer to an earlier request is never taken for a later one;
* self-contained tests go to the harness in runs, ahead of their verdicts; one started ahead is judged on the
  harness's answer even after the sample's total ran out before its turn; one never started is reported
  under its own index; judge_sample leaves no alarm armed.
"""
import json
import signal
import time

from tests.rewards.test_judge_inprocess_40 import Harness, _call_spec, _v, judge

from rewards import _judge as J
from rewards._plain import plain_encode


def _start_answer(names):
    return lambda msg: b"%d " % msg["seq"] + json.dumps({"names": names}).encode() + b"\n"


def test_a_name_reported_as_a_value_that_is_not_plain_fails_and_one_not_reported_is_unbound():
    bad = _start_answer({"k": ["v", {"t": "nope"}]})
    recs, _ = judge([_call_spec(["k"], src="pass")], raw=bad)
    assert _v(recs) == [(False, "bad_value")]
    # the prompt's helper `f` is not what the test gets when the candidate has no `f`
    spec = dict(_call_spec(["f"], src="f(1)"), prelude="def f(x):\n    return x\n")
    recs, _ = judge([spec], names={})
    assert _v(recs) == [(False, "assert_raised:NameError")]


def test_test_code_runs_as_the_judge_module_and_its_code_carries_its_labels(monkeypatch):
    from rewards import _judge_runner
    monkeypatch.setattr(_judge_runner, "_CODE", {})  # compiled here, not found compiled by an earlier test
    src = ("assert __name__ == '__judge__'\n"
           "assert helper.__code__.co_filename == '<prompt helpers>'\n"
           "assert (lambda: 0).__code__.co_filename == '<test 1>'")
    spec = dict(_call_spec([], src=src), prelude="def helper():\n    return 1\n")
    recs, _ = judge([_call_spec([], src="pass"), spec])
    assert _v(recs) == [(True, "ok"), (True, "ok")]


def test_the_candidate_s_exception_says_so_and_a_later_failed_assert_names_it():
    names = {"boom": lambda: 1 // 0}
    tests = [_call_spec(["boom"], src="try:\n    boom()\nexcept ZeroDivisionError as e:\n"
                                      "    assert str(e) == 'raised by the candidate'"),
             _call_spec(["boom"], src="try:\n    boom()\nexcept ZeroDivisionError:\n    pass\nassert False")]
    recs, _ = judge(tests, names=names)
    assert _v(recs) == [(True, "ok"), (False, "raised:ZeroDivisionError")]


def test_stdio_start_fields_status_and_why_bounds_and_an_unrun_capture():
    long_status = "s" * 50
    prog = {"a": ("x", 0, long_status), "b": ("y", 0, "timeout")}
    tests = [{"kind": "stdio", "stdin": "a", "expected": "x"}, {"kind": "stdio", "stdin": "b", "capture": 5}]
    recs, h = judge(tests, test_timeout=1.5, total=9.0, program=lambda s: prog[s])
    assert _v(recs) == [(False, long_status[:40]), (False, "timeout")]
    assert recs[1]["out"] == ""  # it did not run: no value, the empty text
    starts = [m for m in h.received if m["op"] == "start"]
    assert [(m["i"], m["budget"]) for m in starts] == [(0, 1.5), (1, 1.5)]
    # the test code's own exception type is cut to the verdict's 60 characters
    name = "E" * 70
    recs, _ = judge([_call_spec([], src=f"class {name}(Exception):\n    pass\nraise {name}()")])
    assert _v(recs) == [(False, ("assert_raised:" + name)[:60])]


def test_a_caught_deadline_comes_back_at_once_until_the_test_gives_up():
    """Test code that catches everything still ends at its deadline (each test here has 0.05 s): its runner is
    killed by the writer, whatever the code catches, and the sample is over in well under a second. Test 0
    arms its alarm when the harness's ready record arrives (its first call), test 1 at its start."""
    src = "f()\ntry:\n    while True:\n        pass\nexcept BaseException:\n    pass\nwhile True:\n    pass"
    t0 = time.monotonic()
    recs, _ = judge([_call_spec(["f"], src=src)] * 2, test_timeout=0.05, total=5.0, names={"f": lambda: 1},
                    ready_after=0.1)
    took = time.monotonic() - t0
    assert _v(recs) == [(False, "timeout")] * 2
    assert took < 1.0, took  # a repeat of a second or more would take over 2 s


def _sized(size, name):
    """A harness that answers calls of `name` with a record line of exactly `size` bytes before its newline,
    the newline sent 0.2 s later (so the judge has read all of the line but its end when it checks the bound)."""
    class Sized(Harness):
        def call(self, msg):
            if msg["name"] != name:
                return super().call(msg)
            head, body = b'%d {"v": ' % msg["seq"], json.dumps(plain_encode("x")).encode()
            self.sock.sendall(head + body + b" " * (size - len(head) - len(body) - 1) + b"}")
            time.sleep(0.2)
            self.sock.sendall(b"\n")
    return Sized


def test_a_line_is_read_up_to_the_record_cap_and_the_next_test_still_reads_its_answers(monkeypatch):
    import tests.rewards.test_judge_inprocess_40 as H
    bound = 3000
    tests = [_call_spec(["f"], src="assert f() == 'x'"), _call_spec(["g"], src="assert g() == 2")]
    assert J.record_cap(bound) == 6 * bound + 4096
    for size, want in [(J.record_cap(bound), (True, "ok")), (J.record_cap(bound) + 1, (False, "output_limit"))]:
        monkeypatch.setattr(H, "Harness", _sized(size, "f"))
        recs, _ = judge(tests, max_output=bound, names={"f": lambda: "x", "g": lambda: 2})
        assert _v(recs) == [want, (True, "ok")], size


class _Closes(Harness):
    """Closes its side of the channel (for writing) when a call arrives: the candidate's sandbox died."""

    def call(self, msg):
        self.sock.shutdown(__import__("socket").SHUT_WR)


def test_a_channel_the_harness_closed_is_died(monkeypatch):
    import tests.rewards.test_judge_inprocess_40 as H
    monkeypatch.setattr(H, "Harness", _Closes)
    recs, _ = judge([_call_spec(["f"], src="try:\n    f()\nexcept BaseException:\n    pass")], names={"f": len})
    assert _v(recs) == [(False, "died")]


class _Stale(Harness):
    """Never answers f(0); before answering any later call, first replays an answer to every earlier call
    (a late answer, as the harness sends one when a call ran past the judge's deadline)."""

    def run(self):
        self.seen = []
        super().run()

    def call(self, msg):
        for old in self.seen:
            self.line(old, {"v": plain_encode("stale")})
        self.seen.append(msg["seq"])
        if plain_encode([0]) != msg["args"]:
            super().call(msg)


def test_a_stale_answer_is_never_taken_for_a_later_request(monkeypatch):
    import tests.rewards.test_judge_inprocess_40 as H
    monkeypatch.setattr(H, "Harness", _Stale)
    tests = [_call_spec(["f"], src="f(0)")] + [_call_spec(["f"], src=f"assert f({x}) == {x + 1}") for x in (1, 2)]
    recs, _ = judge(tests, test_timeout=0.3, names={"f": lambda x: x + 1})
    assert _v(recs) == [(False, "timeout"), (True, "ok"), (True, "ok")]


def _runs(groups):
    """A harness that answers the starts of each run of self-contained tests (`groups`: lists of test indices)
    only once every start of the run has arrived; a run it had to release after 0.5 s without all of them is
    recorded in `late` (a start the judge did not send ahead with its run)."""
    class Runs(Harness):
        def run(self):
            self.held, self.late = [], []
            super().run()

        def answer(self, msg):
            group = next((g for g in groups if msg["op"] == "start" and msg["i"] in g), None)
            if group is None:
                return super().answer(msg)
            self.held.append(msg)
            if {m["i"] for m in self.held} >= set(group):
                for m in self.held:
                    super().answer(m)
                self.held = []
            elif len(self.held) == 1:
                def release(first=msg):
                    if first in self.held:
                        self.late.append(first["i"])
                        for m in list(self.held):
                            super(Runs, self).answer(m)
                        self.held = []
                __import__("threading").Timer(0.5, release).start()
    return Runs


def test_self_contained_tests_go_to_the_harness_in_runs_ahead_of_their_verdicts(monkeypatch):
    import tests.rewards.test_judge_inprocess_40 as H
    monkeypatch.setattr(H, "Harness", _runs([[0, 1, 2], [4, 5]]))
    sc = [{"kind": "call", "src": f"assert sq({x}) == {x * x}", "names": ["sq"],
           "first": {"name": "sq", "args": plain_encode([x]), "kwargs": plain_encode({})}} for x in range(6)]
    tests = sc[:3] + [_call_spec(["sq"], src="assert sq(3) == 9")] + sc[4:]
    recs, h = judge(tests, test_timeout=3.0, total=20.0, names={"sq": lambda x: x * x})
    assert _v(recs) == [(True, "ok")] * 6 and h.late == []


def test_a_test_started_ahead_is_judged_on_the_harness_s_answer_after_the_total_ran_out(monkeypatch):
    """Tests 0 and 1 start together (self-contained); test 0 spends the sample's whole time after its call, so
    test 1's turn comes with nothing left: its answer was in before, and it is judged on it. Test 2, never
    started, times out under its own index; no alarm is left armed afterwards."""
    # here a runner is a fork of this (large) test process, not of the judge's small zygote: give the test
    # started ahead time for that once the total is spent
    monkeypatch.setattr(J, "MIN_BUDGET_S", 1.0)
    first = {"name": "f", "args": plain_encode([1]), "kwargs": plain_encode({})}
    tests = [{"kind": "call", "src": "assert f(1) == 2\nwhile True:\n    pass", "names": ["f"], "first": first},
             {"kind": "call", "src": "assert f(1) == 2", "names": ["f"], "first": first},
             _call_spec(["f"], src="assert f(1) == 2")]
    recs, h = judge(tests, test_timeout=0.4, total=0.4, names={"f": lambda x: x + 1})
    assert [(r["i"], r["ok"], r["why"]) for r in recs] == [(0, False, "timeout"), (1, True, "ok"),
                                                           (2, False, "timeout")]
    assert [m["i"] for m in h.received if m["op"] == "start"] == [0, 1]


def test_judge_sample_leaves_no_alarm_armed(monkeypatch):
    seen, orig = [], J.judge_sample

    def spy(job, chan, out):
        orig(job, chan, out)
        seen.append(signal.getitimer(signal.ITIMER_REAL))
    monkeypatch.setattr(J, "judge_sample", spy)
    recs, _ = judge([_call_spec(["f"], src="assert f() == 1")] * 2, names={"f": lambda: 1})
    assert _v(recs) == [(True, "ok")] * 2 and seen == [(0.0, 0.0)]
