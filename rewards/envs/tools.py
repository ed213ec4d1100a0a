"""An environment built from plain Python functions described by JSON-schema tool specs.

    def calc(expr: str) -> str:
        "Evaluate an arithmetic expression."
        ...

    env = ToolEnv([Tool(calc, timeout_s=2.0)], score=lambda row, final: ...)

Each tool's spec is in the chat-template function-calling convention (what `tokenizer.apply_chat_template(
messages, tools=[...])` takes): `{"type": "function", "function": {"name", "description", "parameters":
JSON schema}}`; given or built from the signature. The model calls a tool by writing
`<tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>` (Hermes / Qwen form); several calls
in one turn are all run. A turn without a call is the final answer: `score(row, text)` gives the task
reward and the trajectory ends.

Isolation and limits, per tool (`Tool.isolation`):
  * "thread" (default): the function runs in a daemon thread; past `timeout_s` the call is an error
    observation and the thread is abandoned (it cannot be killed, but it never keeps the process from
    exiting; use "process" for tools that may hang and hold memory or the GIL);
  * "process": a forked child runs the call and is killed at `timeout_s`; a crash (signal, exit) is an error;
  * "sandbox": for tools that run untrusted input (model-written code): the function's source and the call
    run as a program in `rewards.sandbox` (no network, no host files, rlimits; killed at `timeout_s`). What
    comes back is text only: everything the call printed, then its return value (`print`ed) when not None,
    cut to `max_chars` by the judge process (the one value that crosses the sandbox's trust boundary,
    docs/rewards.md). The function must be self-contained (its imports inside it); a call that raises or
    exits non-zero is an error.
A tool that hangs, crashes, raises or returns something unprintable becomes an error observation
(`error: ...`), recorded in `info["tool_calls"]`; the environment never raises.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import multiprocessing
import re
import threading
import time
from typing import Any, Callable

from rewards.envs.api import Environment, StepResult

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)  # the format; parsed by tool_call_bodies
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
ISOLATIONS = ("thread", "process", "sandbox")


def spec_from_function(fn: Callable) -> dict:
    """The tool spec of `fn` from its name, docstring and annotated parameters (all required unless
    they have a default)."""
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        props[name] = {"type": _JSON_TYPES.get(p.annotation, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0].strip()
    return {"type": "function", "function": {"name": fn.__name__, "description": doc,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


@dataclasses.dataclass
class Tool:
    """One tool. fn: the function (keyword arguments = the spec's properties); spec: its JSON-schema spec
    (None: `spec_from_function(fn)`); timeout_s: wall-clock limit of one call; isolation: thread | process |
    sandbox (module docstring); max_chars: a longer result is cut to this many characters."""

    fn: Callable
    spec: dict | None = None
    timeout_s: float = 5.0
    isolation: str = "thread"
    max_chars: int = 2000

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"Tool.isolation: choose one of {ISOLATIONS}, got {self.isolation!r}")
        if self.spec is None:
            self.spec = spec_from_function(self.fn)
        if "function" not in self.spec or "name" not in self.spec["function"]:
            raise ValueError(f"tool spec needs {{'type': 'function', 'function': {{'name': ...}}}}, got {self.spec}")

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]


def tool_call_bodies(text: str) -> list[str]:
    """The text between each `<tool_call>` and the first `</tool_call>` after it, left to right (what
    `TOOL_CALL_RE.findall` gives), in one pass of `str.find`: linear in the length of the text. (The
    regular expression is quadratic on policy text that opens many calls and closes none: each opener
    scans to the end; 1.2 s for 64k characters, minutes for a megabyte, holding the GIL.)"""
    bodies, pos = [], 0
    n_open, n_close = len(_OPEN), len(_CLOSE)
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            return bodies
        end = text.find(_CLOSE, start + n_open)
        if end < 0:  # no closer after this opener: none after any later one either
            return bodies
        bodies.append(text[start + n_open:end])
        pos = end + n_close


def parse_tool_calls(text: str) -> list[dict]:
    """Every `<tool_call>...</tool_call>` of a turn, as {"name", "arguments"} or {"error": why}; a turn that
    opens a call and never closes one gives one {"error": "unclosed <tool_call>"}. Linear in the length of
    the text (tool_call_bodies; JSON decoding is linear too)."""
    calls = []
    for body in tool_call_bodies(text):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            calls.append({"error": f"malformed tool call JSON: {str(e)[:80]}", "raw": body[:200]})
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append({"error": "a tool call needs a string 'name'", "raw": body[:200]})
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates serialise the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            calls.append({"error": "tool call 'arguments' must be an object", "name": obj["name"]})
            continue
        calls.append({"name": obj["name"], "arguments": args})
    if not calls and "<tool_call>" in text:  # opened, never closed: a malformed call, not a final answer
        calls.append({"error": "unclosed <tool_call>", "raw": text[text.index("<tool_call>"):][:200]})
    return calls


def validate_arguments(spec: dict, args: dict) -> str | None:
    """None if `args` fit the spec's JSON schema (required keys, no unknown keys, primitive types), else why."""
    params = spec["function"].get("parameters") or {}
    props = params.get("properties") or {}
    for key in params.get("required") or []:
        if key not in args:
            return f"missing argument {key!r}"
    for key, value in args.items():
        if key not in props:
            return f"unknown argument {key!r}"
        want = props[key].get("type")
        py = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
              "object": dict}.get(want)
        if py is not None and (not isinstance(value, py) or (want in ("integer", "number") and isinstance(value, bool))):
            return f"argument {key!r} must be {want}"
    return None


def _to_text(value: Any, max_chars: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:max_chars]


def _run_thread(tool: Tool, args: dict) -> tuple[str, Any]:
    """The call in a daemon thread, waited for up to `timeout_s` seconds. Past it the thread is abandoned:
    a daemon thread, so a hung tool costs its timeout and nothing more (the worker threads of a
    ThreadPoolExecutor are joined at interpreter exit: a process that used a hung tool printed its
    results and then never exited)."""
    box: dict = {}
    finished = threading.Event()

    def target() -> None:
        try:
            box["value"] = ("ok", tool.fn(**args))
        except BaseException as e:  # noqa: B036 - anything the tool raises is its error observation
            box["value"] = ("error", f"{type(e).__name__}: {str(e)[:120]}")
        finally:
            finished.set()

    threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True).start()
    if not finished.wait(tool.timeout_s):
        return "timeout", f"tool timed out after {tool.timeout_s:g} s"
    return box["value"]


def _process_target(fn, args, conn) -> None:  # runs in the forked child
    try:
        conn.send(("ok", fn(**args)))
    except BaseException as e:  # noqa: B036 - anything the tool raises is its error observation
        conn.send(("error", f"{type(e).__name__}: {str(e)[:120]}"))


def _run_process(tool: Tool, args: dict) -> tuple[str, Any]:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_process_target, args=(tool.fn, args, send), daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(tool.timeout_s):
            try:
                return recv.recv()
            except (EOFError, OSError):
                pass  # the child died without answering
            proc.join(1.0)
            return "error", f"tool crashed (exit code {proc.exitcode})"
        return "timeout", f"tool timed out after {tool.timeout_s:g} s"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(2.0)
        recv.close()


def sandbox_program(tool: Tool, args: dict) -> str:
    """The program a "sandbox" tool call runs: the function's source, then the call with `args` (read back
    from a JSON string literal, never formatted into code) and its return value printed when not None."""
    src = inspect.getsource(tool.fn)
    name = tool.fn.__name__
    return (f"{src}\n\nimport json as _json\n_value = {name}(**_json.loads({json.dumps(json.dumps(args))}))\n"
            "if _value is not None:\n    print(_value)\n")


def _run_sandbox(tool: Tool, args: dict, mode: str) -> tuple[str, Any]:
    from rewards.sandbox import Limits, SandboxError, resolve_mode, run_tests

    limits = Limits(test_timeout_s=tool.timeout_s, total_timeout_s=tool.timeout_s + 5.0)
    outputs: list = []
    try:
        ok, why = run_tests(sandbox_program(tool, args), [{"kind": "stdio", "stdin": "", "capture": tool.max_chars}],
                            limits, resolve_mode(mode), outputs)[0]
    except SandboxError as e:
        return "error", f"sandbox failure: {str(e)[:120]}"
    if ok:
        return "ok", outputs[0].rstrip("\n")
    if why == "timeout":
        return "timeout", f"tool timed out after {tool.timeout_s:g} s"
    return "error", f"tool failed in the sandbox ({why})"


def run_tool(tool: Tool, args: dict, sandbox_mode: str = "auto") -> dict:
    """Run one call; never raises. Returns {"name", "arguments", "ok", "result" (text, the observation),
    "error" (None or why), "timeout" (bool), "latency_s"}."""
    t0 = time.monotonic()
    try:
        if tool.isolation == "process":
            status, value = _run_process(tool, args)
        elif tool.isolation == "sandbox":
            status, value = _run_sandbox(tool, args, sandbox_mode)
        else:
            status, value = _run_thread(tool, args)
        text = _to_text(value, tool.max_chars) if status == "ok" else None
    except Exception as e:  # a result that cannot be printed (garbage) is an error too
        status, text, value = "error", None, f"tool returned garbage: {type(e).__name__}"
    ok = status == "ok"
    return {"name": tool.name, "arguments": args, "ok": ok, "result": text if ok else f"error: {value}",
            "error": None if ok else str(value), "timeout": status == "timeout",
            "latency_s": time.monotonic() - t0}


class ToolEnv(Environment):
    """A multi-turn environment over `tools`.

    score(row, final_text) -> float: the task reward of the final (call-free) turn; None scores 0.
    max_turns: the trajectory ends (done) after this many model turns, whatever the last one holds.
    latency_s: extra wall time added to every tool call (a stand-in for slow tools, for benchmarks).
    sandbox_mode: the `rewards.sandbox` mode of "sandbox" tools ("auto" picks the strongest available).
    """

    def __init__(self, tools: list[Tool], score: Callable[[dict, str], float] | None = None, max_turns: int = 4,
                 latency_s: float = 0.0, sandbox_mode: str = "auto"):
        self.tools = {t.name: t for t in tools}
        self.score, self.max_turns, self.latency_s, self.sandbox_mode = score, max_turns, latency_s, sandbox_mode
        self.row: dict = {}
        self.turns = 0

    @property
    def specs(self) -> list[dict]:
        """The tools' specs, for `apply_chat_template(messages, tools=env.specs)`."""
        return [t.spec for t in self.tools.values()]

    def reset(self, row: dict, seed: int | None = None) -> str | None:
        self.row, self.turns = dict(row), 0
        return None

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        calls = parse_tool_calls(turn)
        if not calls:
            reward = float(self.score(self.row, turn) or 0.0) if self.score is not None else 0.0
            return StepResult(None, reward, True, {"final": True, "tool_calls": []})
        records, texts = [], []
        for call in calls:
            if "error" in call:
                rec = {"name": call.get("name"), "arguments": None, "ok": False, "timeout": False, "latency_s": 0.0,
                       "error": call["error"], "result": f"error: {call['error']}", "invalid": True}
            elif call["name"] not in self.tools:
                why = f"unknown tool {call['name']!r}"
                rec = {"name": call["name"], "arguments": call["arguments"], "ok": False, "timeout": False,
                       "latency_s": 0.0, "error": why, "result": f"error: {why}", "invalid": True}
            else:
                tool = self.tools[call["name"]]
                why = validate_arguments(tool.spec, call["arguments"])
                if why is not None:
                    rec = {"name": tool.name, "arguments": call["arguments"], "ok": False, "timeout": False,
                           "latency_s": 0.0, "error": why, "result": f"error: {why}", "invalid": True}
                else:
                    t0 = time.monotonic()
                    if self.latency_s:
                        time.sleep(self.latency_s)
                    rec = dict(run_tool(tool, call["arguments"], self.sandbox_mode), invalid=False)
                    rec["latency_s"] = time.monotonic() - t0  # the stand-in latency is part of the call's time
            records.append(rec)
            texts.append(rec["result"])
        done = self.turns >= self.max_turns
        return StepResult("\n".join(texts), 0.0, done, {"final": False, "tool_calls": records})
