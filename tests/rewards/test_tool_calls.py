"""Round three, the agent path: `<tool_call>` parsing is linear in the policy's text, and a hung tool costs
its timeout and nothing more (the process that used it still exits).

Both run in a child interpreter with a wall-clock limit: a quadratic parse or a process that never exits
must fail the test, not hang the suite.
"""
import json
import os
import random
import subprocess
import sys
import textwrap

from rewards.envs.tools import TOOL_CALL_RE, parse_tool_calls

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1 << 20
# Shapes of a megabyte of policy text: openers without a closer (each opener used to scan to the end),
# closers without openers, nested openers, a long unterminated JSON body, many small calls, and text
# made of near-misses of the tags.
SHAPES = {
    "openers": "<tool_call>" * (MB // 11),
    "opener_then_text": "<tool_call>" + "x" * MB,
    "closers": "</tool_call>" * (MB // 12),
    "nested_openers": ("<tool_call>" * 1000 + "{") * (MB // 11001) + "</tool_call>",
    "deep_json": "<tool_call>" + "[" * MB + "</tool_call>",
    "many_calls": '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * (MB // 52),
    "near_misses": "<tool_call</tool_call<tool_cal>" * (MB // 32),
    "openers_and_half_closers": "<tool_call></tool_cal" * (MB // 21),
}


def _child(code: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def test_a_megabyte_of_any_shape_parses_in_linear_time():
    """Each shape parses in well under a second here; the bound (10 s each, 60 s for all) is far above
    that and far below the quadratic parse (minutes per shape)."""
    code = """
        import json, time
        from tests.rewards.test_tool_calls import SHAPES
        from rewards.envs.tools import parse_tool_calls
        out = {}
        for name, text in SHAPES.items():
            t0 = time.perf_counter()
            calls = parse_tool_calls(text)
            out[name] = [time.perf_counter() - t0, len(calls)]
        print(json.dumps(out))
    """
    res = _child(code, 60.0)
    assert res.returncode == 0, res.stderr[-2000:]
    times = json.loads(res.stdout)
    assert all(t < 10.0 for t, _ in times.values()), times
    assert times["openers"][1] == 1 and times["many_calls"][1] == MB // 52, times


def test_the_linear_parse_finds_what_the_regular_expression_finds():
    from rewards.envs.tools import tool_call_bodies
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "<tool_call", "tool_call>", '{"name": "f"}', "x", "\n", "<", ">", "/"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
        assert tool_call_bodies(text) == TOOL_CALL_RE.findall(text), text
    assert parse_tool_calls("<tool_call>" + "x" * 10) == [{"error": "unclosed <tool_call>",
                                                             "raw": "<tool_call>" + "x" * 10}]


HANGS = {
    "sleep": "time.sleep(3600)",
    "event": "threading.Event().wait()",
    "busy": "while True:\n        pass",
    "pipe": "os.read(os.pipe()[0], 1)",
}


def test_a_hung_tool_costs_its_timeout_and_the_process_exits():
    """A child that calls hanging tools (each shape, and three in one turn) prints its results and must
    exit: the timeouts (0.5 s each, seven in all) plus start-up, far below the 60 s limit."""
    code = """
        import json, os, threading, time
        from rewards.envs.tools import Tool, ToolEnv, run_tool
        HANGS = %r
        def lag():  # how late this loaded machine wakes a sleeping thread, the worst of a few tries
            worst = 0.0
            for _ in range(5):
                t = time.monotonic()
                time.sleep(0.1)
                worst = max(worst, time.monotonic() - t - 0.1)
            return worst
        out = {"lag_before": [lag(), True]}
        for name, body in HANGS.items():
            ns = {"os": os, "threading": threading, "time": time}
            exec("def hang():\\n    " + body + "\\n", ns)
            t0 = time.monotonic()
            rec = run_tool(Tool(ns["hang"], timeout_s=0.5), {})
            out[name] = [time.monotonic() - t0, rec["timeout"]]
        ns = {"time": time}
        exec("def hang(x: int):\\n    time.sleep(3600)\\n", ns)
        env = ToolEnv([Tool(ns["hang"], timeout_s=0.5)])
        env.reset({})
        call = '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
        t0 = time.monotonic()
        step = env.step(call * 3)
        out["turn"] = [time.monotonic() - t0, all(r["timeout"] for r in step.info["tool_calls"])]
        out["lag_after"] = [lag(), True]
        print(json.dumps(out), flush=True)
    """ % (HANGS,)
    res = _child(code, 60.0)  # before the fix: TimeoutExpired (the abandoned threads are joined at exit)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    # a call ends at its timeout, not seconds later: the slack is 0.5 s plus what the machine's own wake-up
    # lag (measured in the child around the calls) can add to a timer and a join, four wake-ups' worth
    slack = 0.5 + 4 * max(out.pop("lag_before")[0], out.pop("lag_after")[0])
    for name, (seconds, timed_out) in out.items():
        limit = 1.5 if name == "turn" else 0.5
        assert timed_out and limit <= seconds < limit + slack, (name, seconds, slack)
