"""Environments from tool functions: call parsing, argument checks, and tools that hang, crash or return
garbage (error observations, never an exception)."""
import os
import signal
import time

import pytest

from rewards.envs import EnvLoadError, StepResult, Tool, ToolEnv, load_environment, make_environment, parse_tool_calls
from rewards.envs.calculator import answer_matches, calc, calculator_env


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


def test_calculator_and_loader(tmp_path):
    assert calc("482*37") == str(482 * 37) and calc("(2+3)*4 - 7 // 2") == "17"
    for bad in ["__import__('os')", "2**999999", "1/0", "x"]:
        with pytest.raises((ValueError, SyntaxError, ZeroDivisionError)):
            calc(bad)
    env = load_environment("calculator")(max_turns=2)
    assert env.reset({"prompt": "Compute 482*37.", "answer": "17834"}) is None
    assert env.step(call("calc", expr="482*37")).observation == "17834"
    assert env.step("\\boxed{17834}").reward == 1.0
    assert answer_matches({"answer": "5"}, "\\boxed{6}") == 0.0
    f = tmp_path / "my_env.py"
    f.write_text("from rewards.envs import Environment, StepResult\n"
                 "class Echo(Environment):\n"
                 "    def step(self, turn):\n"
                 "        return StepResult(turn.upper(), 1.0, True)\n")
    env = make_environment(f"{f}:Echo")
    env.reset({})
    assert env.step("hi") == StepResult("HI", 1.0, True, {})
    with pytest.raises(EnvLoadError, match="no callable"):
        load_environment(f"{f}:Nope")
    with pytest.raises(EnvLoadError, match="unknown environment"):
        load_environment("nope")
    assert calculator_env().max_turns == 3
