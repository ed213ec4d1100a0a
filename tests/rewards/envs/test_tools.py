"""Environments from tool functions (rewards/envs/tools.py): call parsing, argument checks, tools that hang,
crash or return garbage (error observations, never an exception), and the rules no happy-path test pins:
`ToolEnv` allows exactly `max_turns` tool turns, and a sandboxed tool's call ends at its own `timeout_s`, not
seconds later."""
import json
import os
import signal
import time

import pytest

from rewards.envs import Tool, ToolEnv, parse_tool_calls
from rewards.envs.tools import run_tool
from rewards.sandbox import mode_works


def call(name, **args):
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def hang(x: str) -> str:
    time.sleep(60)
    return x


def die(x: str) -> str:
    os.kill(os.getpid(), signal.SIGKILL)


class Unprintable:
    def __repr__(self):
        raise RuntimeError("no")


def garbage(x: str):
    return Unprintable()


def test_spec_from_signature_and_argument_checks():
    tool = Tool(add)
    assert tool.spec == {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                          "parameters": {"type": "object", "required": ["a", "b"],
                                                                         "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}}}}}
    env = ToolEnv([tool], score=lambda row, final: float(final.strip() == row["answer"]), max_turns=10)
    env.reset({"answer": "5"})
    obs, reward, done, info = env.step("let me add " + call("add", a=2, b=3))
    assert (obs, reward, done) == ("5", 0.0, False) and info["tool_calls"][0]["ok"]
    for bad, why in [(call("add", a=2), "missing argument 'b'"), (call("add", a=2, b="3"), "must be integer"),
                     (call("mul", a=1, b=2), "unknown tool"), ("<tool_call>{nope</tool_call>", "malformed"),
                     (call("add", a=1, b=2, c=3), "unknown argument"), ('<tool_call>{"name": "add"}<<tool', "unclosed")]:
        obs, _, done, info = env.step(bad)
        assert why in obs and not done and info["tool_calls"][0]["invalid"], bad
    assert tuple(env.step("5")) == (None, 1.0, True, {"final": True, "tool_calls": []})


def test_parse_several_calls_and_string_arguments():
    text = call("a", x=1) + ' and <tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    assert parse_tool_calls(text) == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_hung_tool_times_out_as_an_error_observation(isolation):
    env = ToolEnv([Tool(hang, timeout_s=0.5, isolation=isolation)])
    env.reset({})
    t0 = time.monotonic()
    obs, _, done, info = env.step(call("hang", x="a"))
    assert time.monotonic() - t0 < 5
    rec = info["tool_calls"][0]
    assert obs.startswith("error: tool timed out") and rec["timeout"] and not rec["ok"] and not done


def test_a_killed_tool_and_a_garbage_result_are_errors():
    env = ToolEnv([Tool(die, isolation="process", timeout_s=5), Tool(garbage)])
    env.reset({})
    obs, _, _, info = env.step(call("die", x="a"))
    assert "tool crashed" in obs and not info["tool_calls"][0]["ok"]
    obs, _, _, info = env.step(call("garbage", x="a"))
    assert obs.startswith("error:") and not info["tool_calls"][0]["ok"]


def square(n: int) -> int:
    """Square n (runs in the sandbox)."""
    return n * n


def loop_forever(n: int) -> int:
    while True:
        pass


def run_python(code: str) -> None:
    """Run model-written Python; what it prints is the observation."""
    exec(code, {"__name__": "__tool__"})


def raise_value(n: int) -> int:
    raise ValueError("no")


def test_sandbox_tools_return_text_and_fail_cleanly():
    """Sandboxed tools: the value comes back as text (printed output, then the return value), bounded by
    max_chars; a call that hangs is killed at its timeout, one that raises is an error; none raises here."""
    from rewards.envs.tools import run_tool

    rec = run_tool(Tool(square, isolation="sandbox", timeout_s=5), {"n": 12})
    assert rec["ok"] and rec["result"] == "144", rec
    rec = run_tool(Tool(run_python, isolation="sandbox", timeout_s=5, max_chars=30),
                   {"code": "import os\nprint(sum(range(10)))\nprint('x' * 100)"})
    assert rec["ok"] and rec["result"].startswith("45\nxxx") and len(rec["result"]) <= 30, rec
    rec = run_tool(Tool(run_python, isolation="sandbox", timeout_s=1), {"code": "while True: pass"})
    assert not rec["ok"] and rec["timeout"] and rec["latency_s"] < 10, rec
    rec = run_tool(Tool(raise_value, isolation="sandbox", timeout_s=5), {"n": 1})
    assert not rec["ok"] and "nonzero_exit" in rec["error"], rec
    # the arguments are data, never code: quotes, backslashes and newlines reach the function verbatim
    code = 'print("it\'s \\"quoted\\" \\\\ done")'
    rec = run_tool(Tool(run_python, isolation="sandbox", timeout_s=5), {"code": code})
    assert rec["ok"] and rec["result"] == 'it\'s "quoted" \\ done', rec


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
