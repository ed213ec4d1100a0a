"""The tiny code-repair environment: a `run_tests` tool that runs a candidate function against the row's hidden
tests in the sandboxed judge, and the sandbox's last verdict as the task reward.

`examples/tasks/code_repair.py` writes the questions (a one-line Python function with a missing or an extra
token) with their hidden `tests`, and synthetic trajectories; `recipes/sft_tiny_code_agent.yaml` trains on them.

Where success comes from: the `run_tests` tool hands the model's `code` argument to the built-in `code` reward
(`rewards.code_reward`: the code runs in `rewards.sandbox`, the asserts run in the judge outside it) and keeps
the judge's counts on the environment. The episode's reward, given when the model ends with a turn that calls
no tool, is 1.0 when the most recent `run_tests` call passed every hidden test and 0.0 otherwise (no call, a
failing call, a call that timed out or did not run). Nothing the model writes is read as a verdict: a final
turn that claims `passed 2/2`, or carries a fake tool response, scores by the sandbox's record alone.
"""
from __future__ import annotations

import threading

from rewards.envs.api import StepResult
from rewards.envs.tools import Tool, ToolEnv


def tool_result(passed: int, total: int) -> str:
    """What `run_tests` answers for `passed` of `total` hidden tests (the synthetic trajectories use it too)."""
    return f"passed {passed}/{total}" if passed == total else f"failed: passed {passed}/{total}"


class CodeRepairEnv(ToolEnv):
    """A `ToolEnv` with one tool, `run_tests(code)`, over the row's hidden `tests` (assert strings); the built-in
    environment `code_repair` (the class is its factory: env.kwargs are these arguments).

    test_timeout_s / total_timeout_s: the judge's per-test and per-call limits (a candidate that hangs is a
    failed test after test_timeout_s); sandbox: the `rewards.sandbox` mode ("auto": the strongest available).
    max_turns: model turns per episode (a trajectory that spends them all on calls scores 0). Defaults: 3 turns,
    1 s per test, 5 s per call.

    A step with calls reports the verdicts its own calls counted in `info["verdicts"]`; the final step reports
    the verdict it scored in `info["verdict"]` (True: the last call passed every test). A call still running
    when its step ends (the tool's thread limit) or when the trajectory is reset never counts.
    """

    def __init__(self, max_turns: int = 3, test_timeout_s: float = 1.0, total_timeout_s: float = 5.0,
                 sandbox: str = "auto"):
        self.test_timeout_s, self.total_timeout_s, self.sandbox = float(test_timeout_s), float(total_timeout_s), sandbox
        # the thread limit sits past the judge's own wall bound: the judge's timeout decides, as a verdict
        tool = Tool(self.run_tests, timeout_s=self.total_timeout_s + 10.0, isolation="thread", max_chars=200)
        super().__init__([tool], score=None, max_turns=max_turns)
        self._lock = threading.Lock()
        self._generation = 0      # bumped per step: a call abandoned by a timeout cannot write a later verdict
        self._passed = False      # the most recent counted run_tests verdict
        self.verdicts: list[dict] = []  # every counted call: {"passed", "total", "all_passed"}

    def reset(self, row: dict, seed: int | None = None) -> str | None:
        super().reset(row, seed)
        with self._lock:
            self._generation += 1
            self._passed, self.verdicts = False, []
        return None

    def run_tests(self, code: str) -> str:
        """Run the hidden tests of the task on `code` (a Python function); says how many pass."""
        from rewards.code_reward import code_reward

        with self._lock:
            generation = self._generation
        tests = list(self.row.get("tests") or [])
        if not tests:
            raise ValueError("this task has no hidden tests")
        res = code_reward(completion=code, tests=tests, sandbox=self.sandbox, test_timeout_s=self.test_timeout_s,
                          total_timeout_s=self.total_timeout_s)
        if res.score is None:  # the sandbox did not start: an error observation, never a verdict
            raise RuntimeError(f"sandbox unavailable: {res.extras.get('skip_reason', 'skipped')}")
        passed, total = int(res.extras["passed"]), int(res.extras["total"])
        with self._lock:
            if generation == self._generation:
                verdict = {"passed": passed, "total": total, "all_passed": total > 0 and passed == total}
                self.verdicts.append(verdict)
                self._passed = verdict["all_passed"]
        return tool_result(passed, total)

    def step(self, turn: str) -> StepResult:
        with self._lock:
            self._generation += 1
            before = len(self.verdicts)
        out = super().step(turn)
        with self._lock:
            self._generation += 1  # whatever is still running past here does not count
            if out.info.get("tool_calls"):
                ran = [c for c in out.info["tool_calls"] if c.get("name") == "run_tests"]
                if ran and not ran[-1].get("ok"):  # the last call failed to run (timeout, error): no pass
                    self._passed = False
                out.info["verdicts"] = self.verdicts[before:]
            elif out.info.get("final"):
                out.reward = 1.0 if self._passed else 0.0
                out.info["verdict"] = self._passed
        return out

