"""The tiny agentic task's environment: a calculator tool, and the boxed answer as the task reward.

`examples/tasks/agent_calc.py` writes the questions (`Compute 482*37.`: products too large for the tiny
model to work out) and synthetic trajectories; `recipes/sft_tiny_agent.yaml` trains on them.
"""
from __future__ import annotations

import ast
import operator
import re

from rewards.envs.tools import Tool, ToolEnv

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


def _eval(node: ast.AST, depth: int = 0) -> int:
    if depth > 50:
        raise ValueError("expression too deep")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise ZeroDivisionError("division by zero")
        out = _OPS[type(node.op)](a, b)
        if abs(out) > 10 ** 30:
            raise ValueError("result too large")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand, depth + 1))
    raise ValueError("only integers and + - * // % are allowed")


def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression (+ - * // %, parentheses)."""
    if len(expr) > 200:
        raise ValueError("expression too long")
    return str(_eval(ast.parse(expr, mode="eval")))


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text`, stripped; None without one."""
    found = BOXED_RE.findall(text)
    return found[-1].strip() if found else None


def answer_matches(row: dict, final: str) -> float:
    """1.0 when the final turn's boxed answer equals the row's `answer`, else 0.0."""
    got = boxed_answer(final)
    return float(got is not None and got == str(row.get("answer", "")).strip())


def calculator_env(max_turns: int = 3, timeout_s: float = 2.0, latency_s: float = 0.0) -> ToolEnv:
    """A `ToolEnv` with the `calc` tool (parsed, never `eval`ed: it runs in-process) and `answer_matches`."""
    return ToolEnv([Tool(calc, timeout_s=timeout_s)], score=answer_matches, max_turns=max_turns, latency_s=latency_s)
