"""Split a row's tests into what runs in the sandbox (probes) and what stays outside (the verdict).

An assert test such as ``assert abs(f(x) - 3.5) < 1e-6`` becomes the probe ``f(x)`` (evaluated in the
sandbox, its value serialised as plain data) and the template ``abs(__p0 - 3.5) < 1e-6`` (evaluated
here, in the parent, on the decoded value). Expected values never enter the sandbox and the decoded
values are plain builtins, so neither a lying ``__eq__`` nor a forged record can pass a test unless
it carries the right value. A subexpression becomes a probe when it needs a name that is not a Python
builtin or one of ``PARENT_MODULES`` (i.e. something the candidate defines); comprehensions and lambdas
that need such names are probed whole. Tests that are not a single ``assert`` statement run whole in
the sandbox ("exec" tests): their pass/fail is reported from inside and is therefore forgeable by a
hostile program; they are counted in ``extras["exec_tests"]``.
stdin/stdout tests ({"input": ..., "output": ...}) send only the input; the output is compared here
after normalising line endings and trailing whitespace.
"""
from __future__ import annotations

import ast
import builtins
import importlib
from typing import Any

PARENT_MODULES = ("math", "cmath", "re", "string", "itertools", "functools", "collections", "heapq",
                  "bisect", "fractions", "decimal", "statistics", "operator")
_BUILTIN_NAMES = set(dir(builtins))
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class TestFormatError(ValueError):
    """A test that is neither an assert/exec string nor an {"input", "output"} dict."""


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _needs_candidate(node: ast.AST) -> bool:
    return any(n not in _BUILTIN_NAMES and n not in PARENT_MODULES for n in _names(node))


class _Splitter(ast.NodeTransformer):
    def __init__(self):
        self.probes: list[tuple[str, list[str]]] = []

    def _probe(self, node):
        src = ast.unparse(node)
        self.probes.append((src, sorted(n for n in _names(node) if n in _BUILTIN_NAMES)))
        return ast.copy_location(ast.Name(id=f"__p{len(self.probes) - 1}", ctx=ast.Load()), node)

    def visit(self, node):
        if not isinstance(node, ast.expr) or not _needs_candidate(node):
            return node
        if isinstance(node, (ast.Name, *_SCOPED)):
            return self._probe(node)
        if isinstance(node, ast.Call):
            func = node.func
            # A call whose callee is the candidate's (f(x), obj.method(x)) is evaluated in the sandbox.
            if _needs_candidate(func):
                return self._probe(node)
        return self.generic_visit(node)


def compile_test(test: Any, index: int) -> dict:
    """One row test -> {"sandbox": harness test dict, "template": code|None, "expected": str|None}."""
    if isinstance(test, dict):
        if "input" not in test or "output" not in test:
            raise TestFormatError(f"test {index}: a dict test needs 'input' and 'output' keys, got {sorted(test)}")
        return {"sandbox": {"kind": "stdio", "stdin": str(test["input"])}, "template": None,
                "expected": str(test["output"])}
    if not isinstance(test, str):
        raise TestFormatError(f"test {index}: expected an assert string or an input/output dict, "
                              f"got {type(test).__name__}")
    try:
        tree = ast.parse(test.strip())
    except SyntaxError as e:
        raise TestFormatError(f"test {index}: syntax error in {test!r}: {e.msg}") from e
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
        splitter = _Splitter()
        template = splitter.visit(tree.body[0].test)
        expr = ast.Expression(body=template)
        ast.fix_missing_locations(expr)
        return {"sandbox": {"kind": "probe", "exprs": splitter.probes},
                "template": compile(expr, f"<test {index}>", "eval"), "expected": None}
    return {"sandbox": {"kind": "exec", "src": test}, "template": None, "expected": None, "exec": True}


def decode(v: Any, depth: int = 0) -> Any:
    """Inverse of the harness's ``_encode``; builds only plain builtins. Raises ValueError if malformed."""
    if depth > 70 or not isinstance(v, list) or not v:
        raise ValueError("malformed value")
    tag = v[0]
    if tag == "n":
        return None
    if tag == "b" and isinstance(v[1], bool):
        return v[1]
    if tag == "i":
        return int(v[1])
    if tag == "f":
        return float(v[1])
    if tag == "c":
        return complex(float(v[1]), float(v[2]))
    if tag == "s" and isinstance(v[1], str):
        return v[1]
    if tag == "y":
        return bytes.fromhex(v[1])
    if tag in ("l", "t", "S", "F"):
        items = [decode(x, depth + 1) for x in v[1]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v[1]}
    raise ValueError(f"malformed value tag {tag!r}")


def _normalize_output(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge(compiled: dict, record: dict | None) -> tuple[bool, str]:
    """Verdict for one test from the harness record (None: the harness died first). Runs in the parent."""
    if record is None:
        return False, "no_record"
    if record.get("status") != "ok":
        return False, str(record.get("status"))
    kind = compiled["sandbox"]["kind"]
    if kind == "stdio":
        if record.get("exit") != 0:
            return False, "nonzero_exit"
        ok = _normalize_output(record.get("stdout", "")) == _normalize_output(compiled["expected"])
        return ok, "ok" if ok else "wrong_output"
    if "error" in record:
        return False, f"raised:{str(record['error'])[:40]}"
    values = record.get("values")
    if not isinstance(values, list) or len(values) != (len(compiled["sandbox"]["exprs"]) if kind == "probe" else 1):
        return False, "bad_record"
    try:
        decoded = [decode(v) for v in values]
    except (ValueError, TypeError, OverflowError):
        return False, "bad_value"
    if kind == "exec":
        return decoded == [True], "ok" if decoded == [True] else "failed"
    scope = {m: importlib.import_module(m) for m in PARENT_MODULES}
    scope.update({f"__p{i}": v for i, v in enumerate(decoded)})
    try:
        ok = bool(eval(compiled["template"], {"__builtins__": builtins}, scope))
    except Exception as e:
        return False, f"assert_raised:{type(e).__name__}"
    return ok, "ok" if ok else "assert_failed"
