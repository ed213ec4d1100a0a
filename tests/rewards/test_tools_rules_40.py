"""Rules of the tool environment that no happy-path test pins (issue 40): `ToolEnv` allows exactly `max_turns`
tool turns, and a sandboxed tool's call ends at its own `timeout_s`, not seconds later."""
import json
import time

import pytest

from rewards.envs.tools import Tool, ToolEnv, run_tool
from rewards.sandbox import mode_works


def echo(text: str) -> str:
    """Return the text."""
    return text


def spin(n: int) -> str:
    """Never return."""
    while True:
        n += 1


def quick(n: int) -> str:
    """Return at once."""
    return str(n)


def _call(name="echo", **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args or {"text": "hi"}}) + "</tool_call>"


@pytest.mark.parametrize("max_turns", [1, 2, 3, 5])
def test_tool_env_allows_exactly_max_turns_tool_turns(max_turns):
    """A trajectory of tool-calling turns is done at turn max_turns, never before, whatever the calls hold
    (a good call, an unknown tool, bad arguments, an unclosed call); a reset starts the count again."""
    turns = [_call(), _call("nope"), _call(text=3), "<tool_call>{", _call()]
    env = ToolEnv([Tool(echo, timeout_s=2.0)], max_turns=max_turns)
    for _ in range(2):  # the second episode: reset must restart the count
        env.reset({"q": 1})
        for k in range(1, max_turns + 1):
            res = env.step(turns[(k - 1) % len(turns)])
            assert res.done == (k == max_turns), (k, max_turns)
            assert not res.info["final"] and res.info["tool_calls"]


@pytest.mark.parametrize("max_turns", [1, 3])
def test_a_final_answer_ends_the_trajectory_at_any_turn(max_turns):
    for answer_at in range(1, max_turns + 1):
        env = ToolEnv([Tool(echo, timeout_s=2.0)], score=lambda row, text: 1.0, max_turns=max_turns)
        env.reset({})
        for _ in range(1, answer_at):
            assert not env.step(_call()).done
        res = env.step("The answer is 4.")
        assert res.done and res.reward == 1.0 and res.info["final"]


SANDBOX_MODES = [m for m in ("bwrap", "unshare", "rlimits") if m == "rlimits" or mode_works(m)]


@pytest.mark.parametrize("mode", SANDBOX_MODES[:1] + (["rlimits"] if SANDBOX_MODES[0] != "rlimits" else []))
def test_a_sandboxed_tool_call_ends_at_its_own_timeout(mode):
    """The call of a tool that never returns takes at least its timeout_s and at most timeout_s plus what a
    call that returns at once costs here (the sandbox's start and stop), plus a margin for scheduling."""
    fast = Tool(quick, timeout_s=5.0, isolation="sandbox")
    cost = max(run_tool(fast, {"n": 1}, mode)["latency_s"] for _ in range(2))  # the first may compile the harness
    assert run_tool(fast, {"n": 7}, mode)["result"] == "7"
    for timeout_s in (0.3, 0.8):
        t0 = time.monotonic()
        out = run_tool(Tool(spin, timeout_s=timeout_s, isolation="sandbox"), {"n": 0}, mode)
        took = time.monotonic() - t0
        assert out["timeout"] and not out["ok"] and "timed out" in out["error"]
        assert timeout_s <= took <= timeout_s + cost + 0.6, (timeout_s, took, cost)
