"""`judge_sample` of rewards/_judge.py run in this process, through socket pairs, against the plain harness of
channel.py (or a variant that breaks one rule of the protocol on purpose). The end-to-end tests
(test_semantics.py, test_output.py) run the judge as the reward process does, in its own process, where a
mutation tool cannot see it; these pin the same rules where it can.

* a test fails when a call failed, whatever the test code did after it; an assert that fails is
  `assert_failed` (or `raised:<name>` when the candidate raised), another exception `assert_raised:<type>`;
  a name the candidate reports as a value that is not plain data fails the test (`bad_value`); a name it does
  not report is unbound even when the prompt's helpers define it;
* test code runs as module `__judge__`; prompt helpers and tests carry their labels (tracebacks name them);
* stdio output is compared as documented; a capture test's stdout is its value, cut to its bound; a harness
  status is cut to 40 characters, a verdict's why to 60; a capture test that did not run has the empty string;
* every test has its own deadline (its timeout, cut to what is left of the sample's total); the sample's clock
  starts when the harness says it is ready; a test whose time is spent before it starts is a timeout; a caught
  deadline comes back at once until the test gives up;
* the harness's records are read up to max_output_bytes * 6 + 4096 bytes a line, one byte more is
  `output_limit`; the test after it still reads its own answers; a channel closed by the harness is `died`;
* requests are numbered afresh: a stale answer to an earlier request is never taken for a later one;
* self-contained tests go to the harness in runs, ahead of their verdicts; one started ahead is judged on the
  harness's answer even after the sample's total ran out before its turn; judge_sample leaves no alarm armed.
"""
import json
import signal
import time

from rewards import _judge as J
from rewards._plain import plain_encode
from tests.rewards.judge.channel import Harness, _call_spec, _v, judge


def test_call_tests_pass_fail_and_name_why():
    names = {"add": lambda a, b: a + b, "k": 7, "boom": lambda: 1 // 0, "obj": lambda: {1: [2]}}
    tests = [_call_spec(["add"], src="assert add(2, 3) == 5"),
             _call_spec(["add"], src="assert add(2, 3) == 6"),
             _call_spec(["add", "k"], src="assert add(k, 1) == 8"),
             _call_spec(["boom"], src="boom()"),
             _call_spec(["boom"], src="try:\n    boom()\nexcept ZeroDivisionError:\n    pass"),
             _call_spec(["boom"], src="assert boom() == 1"),
             _call_spec(["missing"], src="missing()"),
             _call_spec(["add"], src="[].pop()"),
             _call_spec(["obj"], src="assert obj() == {1: [2]}")]
    recs, h = judge(tests, names=names)
    assert _v(recs) == [(True, "ok"), (False, "assert_failed"), (True, "ok"), (False, "raised:ZeroDivisionError"),
                        (True, "ok"), (False, "raised:ZeroDivisionError"), (False, "assert_raised:NameError"),
                        (False, "assert_raised:IndexError"), (True, "ok")]
    assert [r["i"] for r in recs] == list(range(len(tests)))
    assert h.received[-1] == {"op": "bye"}


def test_prefetched_calls_are_answered_from_the_start_and_sent_ahead():
    names = {"sq": lambda x: x * x}
    tests = [{"kind": "call", "src": f"assert sq({x}) == {x * x if x != 2 else 5}", "names": ["sq"],
              "first": {"name": "sq", "args": plain_encode([x]), "kwargs": plain_encode({})}} for x in range(4)]
    recs, h = judge(tests, names=names)
    assert _v(recs) == [(True, "ok"), (True, "ok"), (False, "assert_failed"), (True, "ok")]
    starts = [m for m in h.received if m["op"] == "start"]
    assert len(starts) == 4 and all("first" in m for m in starts)
    assert not [m for m in h.received if m["op"] == "call"]  # every call was the prefetched one


def test_a_prefetched_call_that_the_test_does_not_make_is_dropped():
    names = {"sq": lambda x: x * x}
    tests = [{"kind": "call", "src": "assert sq(3) == 9 and sq(2) == 4", "names": ["sq"],
              "first": {"name": "sq", "args": plain_encode([5]), "kwargs": plain_encode({})}}]
    recs, h = judge(tests, names=names)
    assert _v(recs) == [(True, "ok")]
    assert [m["args"] for m in h.received if m["op"] == "call"] == [plain_encode([3]), plain_encode([2])]


def test_a_failed_call_fails_the_test_whatever_the_test_code_does():
    bad = {"bad_value": lambda msg: b"%d " % msg["seq"] + b'{"v": {"t": "nope"}}\n',
           "bad_record": lambda msg: b"%d garbage\n" % msg["seq"],
           "died": lambda msg: b'%dh {"h": "died"}\n' % msg["seq"]}
    src = "try:\n    f()\nexcept BaseException:\n    pass"
    for why, raw in bad.items():
        def answer(msg, raw=raw):
            if msg["op"] == "start":
                return b'%d {"names": {"f": ["fn"]}}\n' % msg["seq"]
            return raw(msg)
        recs, _ = judge([_call_spec(["f"], src=src)], raw=answer)
        assert _v(recs) == [(False, why)], why


def test_a_call_with_arguments_that_are_not_plain_fails():
    recs, h = judge([_call_spec(["f"], src="f(object())"), _call_spec(["f"], src="assert f(1) == 1")],
                    names={"f": lambda x: x})
    assert _v(recs) == [(False, "bad_argument"), (True, "ok")]


def test_stdio_tests_compare_as_documented_and_capture_their_value():
    prog = {"a": ("1 2\n", 0, "ok"), "b": (" 1 2\n", 0, "ok"), "c": ("1 2  \r\n\n", 0, "ok"), "d": ("1 2\n", 3, "ok"),
            "e": ("", -9, "timeout"), "f": ("long output" * 3, 0, "ok"), "g": ("x", 1, "ok")}
    tests = [{"kind": "stdio", "stdin": s, "expected": "1 2"} for s in "abcde"]
    tests += [{"kind": "stdio", "stdin": "f", "capture": 7}, {"kind": "stdio", "stdin": "g", "capture": 5}]
    recs, h = judge(tests, program=lambda s: prog[s])
    assert _v(recs) == [(True, "ok"), (False, "wrong_output"), (True, "ok"), (False, "nonzero_exit"),
                        (False, "timeout"), (True, "ok"), (False, "nonzero_exit")]
    assert recs[5]["out"] == "long ou" and recs[6]["out"] == "x"
    assert all("out" not in r for r in recs[:5])
    assert [m["stdin"] for m in h.received if m["op"] == "start"] == list("abcdefg")


def test_each_test_has_its_own_deadline_and_the_rest_time_out_once_the_total_is_spent():
    tests = [_call_spec([], src="while True:\n    pass"),
             _call_spec([], src="try:\n    while True:\n        pass\nexcept BaseException:\n    pass"),  # caught
             _call_spec(["f"], src="assert f() == 1"),
             _call_spec([], src="while True:\n    pass"),
             _call_spec(["f"], src="assert f() == 1")]
    t0 = time.monotonic()
    # (each test's code runs in a runner forked from this test process: test 2 gets 0.4 s for that)
    recs, h = judge(tests, test_timeout=0.6, total=1.6, names={"f": lambda: 1})
    took = time.monotonic() - t0
    assert _v(recs)[:3] == [(False, "timeout"), (False, "timeout"), (True, "ok")]
    # tests 0 and 1 use 0.6 s each, test 3 what test 2 left of the total; the last one is never started
    assert _v(recs)[3:] == [(False, "timeout"), (False, "timeout")]
    assert [m["i"] for m in h.received if m["op"] == "start"] == [0, 1, 2, 3]
    assert 1.5 < took < 4.0, took


def test_the_sample_clock_starts_when_the_harness_is_ready():
    # the harness is slow to start (longer than the sample's total): the tests still get their time
    recs, _ = judge([_call_spec(["f"], src="assert f() == 1")] * 3, test_timeout=0.5, total=1.0,
                    names={"f": lambda: 1}, ready_after=1.2)
    assert _v(recs) == [(True, "ok")] * 3


def test_a_slow_answer_is_a_timeout_of_that_test_only():
    recs, _ = judge([_call_spec(["f"], src="assert f(1) == 1"), _call_spec(["f"], src="assert f(2) == 2"),
                     _call_spec(["f"], src="assert f(3) == 3")], test_timeout=0.4, total=5.0,
                    names={"f": lambda x: x}, delay=lambda m: 0.6 if m.get("args") == plain_encode([2]) else 0.0)
    assert _v(recs) == [(True, "ok"), (False, "timeout"), (True, "ok")]


def test_output_over_the_cap_is_output_limit():
    """A line longer than the cap on a harness line (`record_cap` of the job's output bound: six bytes per byte
    of output, the most JSON's escapes cost, plus 4096 of framing) is cut off as output_limit; one within it
    passes (both lines are longer than a socket buffer, so they arrive in several pieces)."""
    big = "x" * (1 << 20)
    line = len(json.dumps({"v": plain_encode(big)})) + 2  # "<seq> " with a one-digit seq

    def raw(msg):
        if msg["op"] == "start":
            return b'%d {"names": {"f": ["fn"]}}\n' % msg["seq"]
        return b"%d " % msg["seq"] + json.dumps({"v": plain_encode(big)}).encode() + b"\n"
    over = (line - 4096) // 6 - 1  # the largest bound whose cap is below the line
    assert J.record_cap(over) < line <= J.record_cap(over + 2)
    for bound, want in [(100, (False, "output_limit")), (over, (False, "output_limit")),
                        (over + 2, (True, "ok"))]:
        recs, _ = judge([_call_spec(["f"], src="assert f() == 'x' * (1 << 20)")], max_output=bound, raw=raw)
        assert _v(recs) == [want], bound


def test_prompt_helpers_and_parent_modules_are_in_the_test_scope():
    src = "assert helper(f(2)) == 5 and math.sqrt(16) == 4 and collections.Counter('aa')['a'] == 2"
    spec = dict(_call_spec(["f"], src=src), prelude="def helper(x):\n    return x + 1\n")
    recs, _ = judge([spec, _call_spec(["f"], src="helper(1)")], names={"f": lambda x: 2 * x})
    assert _v(recs) == [(True, "ok"), (False, "assert_raised:NameError")]  # helpers belong to their test only


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
    import tests.rewards.judge.channel as H
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
    import tests.rewards.judge.channel as H
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
    import tests.rewards.judge.channel as H
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
    import tests.rewards.judge.channel as H
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
