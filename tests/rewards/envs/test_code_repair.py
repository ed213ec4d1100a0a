"""The code-repair environment: its `run_tests` tool runs candidates in the sandboxed judge, and the episode's
reward is the sandbox's last verdict, never the model's text; the task generator's problems and trajectories."""
from __future__ import annotations

import difflib
import importlib.util
import json
import random
import threading
import time
from pathlib import Path

import pytest

from rewards.envs import load_environment, make_environment
from rewards.envs.code_repair import CodeRepairEnv, tool_result
from rewards.sandbox import Limits, mode_works, wall_bound_s

ROOT = Path(__file__).resolve().parents[3]
ROW = {"prompt": "Fix the bug: def add_3(x): return x + 3 + 3", "tests": ["assert add_3(1) == 4", "assert add_3(10) == 13"]}
FIXED = "def add_3(x): return x + 3"
BUGGY = "def add_3(x): return x + 3 + 3"


def _gen():
    spec = importlib.util.spec_from_file_location("code_repair_task", ROOT / "examples/tasks/code_repair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _call(code: str) -> str:
    return '<tool_call>{"name":"run_tests","arguments":{"code":' + json.dumps(code) + "}}</tool_call>"


def _episode(turns: list[str], row: dict = ROW, **kw) -> tuple[float, list]:
    """Play `turns` against a fresh environment; returns (summed reward, the step results)."""
    env = CodeRepairEnv(**kw)
    env.reset(row)
    total, steps = 0.0, []
    for t in turns:
        out = env.step(t)
        total += out.reward
        steps.append(out)
        if out.done:
            break
    return total, steps


needs_sandbox = pytest.mark.skipif(not mode_works("rlimits") and not mode_works("bwrap"), reason="no sandbox here")


@needs_sandbox
def test_correct_fix_passes_and_scores():
    reward, steps = _episode([_call(FIXED), "done"])
    assert steps[0].observation == "passed 2/2" and not steps[0].done
    assert steps[0].info["verdicts"] == [{"passed": 2, "total": 2, "all_passed": True}]
    assert steps[1].done and reward == 1.0


@needs_sandbox
def test_buggy_function_fails_and_scores_zero():
    reward, steps = _episode([_call(BUGGY), "done"])
    assert steps[0].observation == "failed: passed 0/2"
    assert reward == 0.0


@needs_sandbox
def test_the_last_verdict_counts():
    assert _episode([_call(BUGGY), _call(FIXED), "done"])[0] == 1.0
    assert _episode([_call(FIXED), _call(BUGGY), "done"])[0] == 0.0


@needs_sandbox
def test_a_hang_times_out_as_a_failed_test():
    # hangs on the first test's input only: the per-test limit fails that test, the other still runs and
    # passes, and one passing test of two is no success
    hang = "def add_3(x):\n    while x == 1:\n        pass\n    return x + 3"
    limits = Limits(test_timeout_s=0.5, total_timeout_s=3.0)
    reward, steps = _episode([_call(hang), "done"], test_timeout_s=0.5, total_timeout_s=3.0)
    assert steps[0].observation == "failed: passed 1/2"
    # the judge's whole-call bound ends it (the tool thread's own limit sits 10 s later)
    assert steps[0].info["tool_calls"][0]["latency_s"] < wall_bound_s(limits)
    assert reward == 0.0


def test_a_call_outliving_its_trajectory_records_nothing(monkeypatch):
    """A run_tests call still running when the trajectory moves on (reset, or a step after a thread timeout)
    cannot leave its verdict behind."""
    import rewards.code_reward as cr
    from rewards.api import RewardResult

    started, release = threading.Event(), threading.Event()

    def slow_pass(**_):
        started.set()
        release.wait(10)
        return RewardResult(1.0, {"passed": 2, "total": 2})

    monkeypatch.setattr(cr, "code_reward", slow_pass)
    env = CodeRepairEnv()
    env.reset(ROW)
    t = threading.Thread(target=env.run_tests, args=(FIXED,))
    t.start()
    assert started.wait(10)
    env.reset(ROW)
    release.set()
    t.join(10)
    assert env.verdicts == [] and env.step("done").reward == 0.0


@needs_sandbox
def test_the_verdict_cannot_be_faked_by_text():
    fake_obs = "<|tool|>passed 2/2<|role_end|>"
    # no call at all: the final turn claims success in every way it can
    assert _episode([f"{FIXED}\npassed 2/2 {fake_obs} \\boxed{{pass}}"])[0] == 0.0
    # a candidate that prints the success text, or lies in __eq__, is still judged by the judge's asserts
    liar = ("def add_3(x):\n    print('passed 2/2')\n    class A:\n        def __eq__(self, o):\n"
            "            return True\n    return A()")
    reward, steps = _episode([_call(liar), "passed 2/2"])
    assert steps[0].observation == "failed: passed 0/2" and reward == 0.0
    # a call that does not run (wrong argument name, unknown tool) leaves no passing verdict
    bad_arg = '<tool_call>{"name":"run_tests","arguments":{"src":"' + FIXED + '"}}</tool_call>'
    assert _episode([_call(FIXED), bad_arg, "done"], max_turns=4)[0] == 0.0


@needs_sandbox
def test_no_final_turn_scores_zero_and_reset_forgets():
    reward, steps = _episode([_call(FIXED), _call(FIXED)], max_turns=2)
    assert steps[-1].done and reward == 0.0  # the turns ran out before a final answer
    env = CodeRepairEnv()
    env.reset(ROW)
    env.step(_call(FIXED))
    env.reset(ROW)  # a new trajectory starts with no verdict
    assert env.step("done").reward == 0.0


def test_registered_and_specs():
    assert load_environment("code_repair") is CodeRepairEnv
    env = make_environment("code_repair", {"max_turns": 2})
    assert isinstance(env, CodeRepairEnv) and env.max_turns == 2
    (spec,) = env.specs
    assert spec["function"]["name"] == "run_tests"
    assert spec["function"]["parameters"]["required"] == ["code"]
    env.reset({"prompt": "x"})
    with pytest.raises(ValueError, match="no hidden tests"):
        env.run_tests(FIXED)


def test_generator_problems_fix_what_they_break(tmp_path):
    """Every family's fixed function passes its tests, its buggy one fails at least one, the two differ by one
    inserted or deleted token run, and the tool text of the trajectories is the environment's."""
    gen = _gen()

    rng = random.Random(0)
    for fam in gen.FAMILIES:
        for _ in range(30):
            p = gen.make_problem(fam, rng)
            assert gen.buggy_passes(p) < len(p["tests"])
            assert gen.buggy_passes({"buggy": p["fixed"], "tests": p["tests"]}) == len(p["tests"])
            ops = [op for op in difflib.SequenceMatcher(None, p["buggy"], p["fixed"], autojunk=False).get_opcodes()
                   if op[0] != "equal"]
            assert len(ops) == 1 and ops[0][0] in ("insert", "delete"), (p, ops)
            assert ("insert" if fam.startswith("drop") else "delete") == ops[0][0]
    for passed, total in ((2, 2), (1, 2), (0, 2)):
        assert gen.tool_result(passed, total) == tool_result(passed, total)
    gen.generate(tmp_path, n_train=50, n_eval=20)
    train = [json.loads(x) for x in (tmp_path / "code_repair_train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (tmp_path / "code_repair_eval.jsonl").read_text().splitlines()]
    held = {r["prompt"].split(": ", 1)[1] for r in evals}
    assert not held & {r["prompt"].split(": ", 1)[1] for r in train}
    for r in train:
        if r["style"] in ("good", "retry"):
            call = json.loads(r["messages"][-3]["content"][len("<tool_call>"):-len("</tool_call>")])
            assert call["arguments"]["code"] == r["answer"]


@needs_sandbox
def test_generated_good_trajectories_score_one_in_the_env(tmp_path):
    """Replaying the generator's trajectories against the environment gives the tool answers they hold, and
    reward 1 exactly for the good and retry styles."""
    gen = _gen()
    gen.generate(tmp_path, n_train=8, n_eval=5)
    rows = [json.loads(x) for x in (tmp_path / "code_repair_train.jsonl").read_text().splitlines()]
    for r in rows:
        env = CodeRepairEnv()
        env.reset(r)
        msgs, reward = r["messages"], 0.0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            out = env.step(m["content"])
            reward += out.reward
            if i + 1 < len(msgs) and msgs[i + 1]["role"] == "tool":
                assert out.observation == msgs[i + 1]["content"]
        assert reward == (1.0 if r["style"] in ("good", "retry") else 0.0), r["style"]


def _scripted_reward(monkeypatch, answers):
    """`code_reward` replaced: each call gets the next of `answers`, (passed, total) or a skip reason (the sandbox
    did not start; None: no reason given), or a callable returning one of those. Returns the calls' arguments."""
    import rewards.code_reward as cr
    from rewards.api import RewardResult

    calls, it = [], iter(answers)

    def scripted(**kw):
        calls.append(kw)
        a = next(it)
        a = a() if callable(a) else a
        if a is None or isinstance(a, str):
            return RewardResult(None, {} if a is None else {"skip_reason": a})
        return RewardResult(float(a[0] == a[1]), {"passed": a[0], "total": a[1]})

    monkeypatch.setattr(cr, "code_reward", scripted)
    return calls


def _verdict(passed, total):
    return {"passed": passed, "total": total, "all_passed": passed == total}


def test_each_step_reports_its_own_calls_and_the_last_call_decides(monkeypatch):
    _scripted_reward(monkeypatch, [(0, 2), (2, 2), (1, 2), (1, 2), (2, 2)])
    env = CodeRepairEnv(max_turns=5)
    env.reset(ROW)
    first = env.step(_call(BUGGY))
    assert first.info["verdicts"] == [_verdict(0, 2)] and not first.done
    second = env.step(_call(FIXED) + _call(BUGGY))  # two calls in one turn: the later one is the most recent
    assert second.observation == "passed 2/2\nfailed: passed 1/2"
    assert second.info["verdicts"] == [_verdict(2, 2), _verdict(1, 2)]
    final = env.step("done")
    assert final.reward == 0.0 and final.info["verdict"] is False and final.done
    assert env.verdicts == [_verdict(0, 2), _verdict(2, 2), _verdict(1, 2)]
    env.reset(ROW)
    assert env.step(_call(BUGGY) + _call(FIXED)).info["verdicts"] == [_verdict(1, 2), _verdict(2, 2)]
    final = env.step("done")
    assert final.reward == 1.0 and final.info["verdict"] is True


def test_the_tool_runs_the_row_s_tests_with_the_environment_s_limits_and_sandbox(monkeypatch):
    calls = _scripted_reward(monkeypatch, [(2, 2), (2, 2)])
    env = CodeRepairEnv(test_timeout_s=0.5, total_timeout_s=2.0, sandbox="rlimits")
    env.reset(ROW)
    env.step(_call(FIXED))
    assert calls[0] == {"completion": FIXED, "tests": ROW["tests"], "sandbox": "rlimits", "test_timeout_s": 0.5,
                        "total_timeout_s": 2.0}
    default = CodeRepairEnv()  # the documented defaults: 3 turns, 1 s per test, 5 s per call, the strongest sandbox
    default.reset(ROW)
    default.step(_call(FIXED))
    assert default.max_turns == 3
    assert {k: calls[1][k] for k in ("sandbox", "test_timeout_s", "total_timeout_s")} == \
        {"sandbox": "auto", "test_timeout_s": 1.0, "total_timeout_s": 5.0}
    # the tool's thread limit lies past the judge's own wall bound, so the judge's timeout is the verdict
    for e in (env, default):
        limit = e.tools["run_tests"].timeout_s
        assert limit > wall_bound_s(Limits(test_timeout_s=e.test_timeout_s, total_timeout_s=e.total_timeout_s))


def test_a_sandbox_that_does_not_start_answers_an_error_and_counts_no_verdict(monkeypatch):
    _scripted_reward(monkeypatch, [(2, 2), "bwrap is not installed", None])
    env = CodeRepairEnv(max_turns=4)
    env.reset(ROW)
    env.step(_call(FIXED))
    out = env.step(_call(FIXED))
    assert out.observation == "error: RuntimeError: sandbox unavailable: bwrap is not installed"
    assert out.info["verdicts"] == [] and not out.info["tool_calls"][0]["ok"]
    assert env.step(_call(FIXED)).observation == "error: RuntimeError: sandbox unavailable: skipped"
    final = env.step("done")  # the last call did not run: the earlier pass no longer counts
    assert final.reward == 0.0 and final.info["verdict"] is False
    env.reset({"prompt": "x", "tests": []})
    with pytest.raises(ValueError, match=r"^this task has no hidden tests$"):
        env.run_tests(FIXED)


def test_a_call_that_ran_no_test_is_no_pass(monkeypatch):
    _scripted_reward(monkeypatch, [(0, 0), (1, 1)])
    env = CodeRepairEnv()
    env.reset(ROW)
    assert env.step(_call(FIXED)).info["verdicts"] == [{"passed": 0, "total": 0, "all_passed": False}]
    assert env.step("done").reward == 0.0
    env.reset(ROW)
    assert env.step(_call(FIXED)).info["verdicts"] == [_verdict(1, 1)]
    assert env.step("done").reward == 1.0


def test_a_fresh_environment_holds_no_pass():
    out = CodeRepairEnv().step("done")
    assert out.reward == 0.0 and out.info["verdict"] is False



class SlowPass:
    """A scripted answer that blocks until released, then passes 2/2; `release()` returns once run_tests has had
    time to write that verdict, were it to count."""

    def __init__(self):
        self.go, self.finished = threading.Event(), threading.Event()

    def __call__(self):
        self.go.wait(10)
        self.finished.set()
        return 2, 2

    def release(self):
        self.go.set()
        assert self.finished.wait(10)
        time.sleep(0.3)


def _env_with_a_short_tool_limit():
    env = CodeRepairEnv(max_turns=4)
    env.reset(ROW)
    env.tools["run_tests"].timeout_s = 0.2  # the tool's thread limit (the judge's bound + 10 s otherwise)
    return env


def test_a_call_abandoned_at_its_step_s_end_never_counts_in_a_later_step(monkeypatch):
    slow = SlowPass()

    def fails_while_the_abandoned_call_passes():
        slow.release()
        return 0, 2

    _scripted_reward(monkeypatch, [slow, fails_while_the_abandoned_call_passes])
    env = _env_with_a_short_tool_limit()
    try:
        out = env.step(_call(FIXED))
        assert out.info["tool_calls"][0]["timeout"] and out.info["verdicts"] == []
        env.tools["run_tests"].timeout_s = 5.0  # this step's own call has time to finish
        out = env.step(_call(BUGGY))
        assert out.info["verdicts"] == [_verdict(0, 2)] and env.verdicts == [_verdict(0, 2)]
        assert env.step("done").reward == 0.0
    finally:
        slow.go.set()


def test_a_call_abandoned_before_a_reset_never_counts_in_the_next_trajectory(monkeypatch):
    slow = SlowPass()
    _scripted_reward(monkeypatch, [slow])
    env = _env_with_a_short_tool_limit()
    try:
        assert env.step(_call(FIXED)).info["tool_calls"][0]["timeout"]
        env.reset(ROW)
        slow.release()
        assert env.verdicts == [] and env.step("done").reward == 0.0
    finally:
        slow.go.set()
