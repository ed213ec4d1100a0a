"""Split a row's tests into what runs in the sandbox (probes) and what stays outside (the verdict).

An assert test such as ``assert abs(f(x) - 3.5) < 1e-6`` becomes the probe ``f(x)`` (evaluated in the
sandbox, its value serialised as plain data) and the template ``abs(__p0 - 3.5) < 1e-6`` (evaluated
here, in the parent, on the decoded value). Expected values never enter the sandbox and the decoded
values are plain builtins, so neither a lying ``__eq__`` nor a forged record can pass a test unless
it carries the right value. A subexpression becomes a probe when it needs a name that is not a Python
builtin or one of ``PARENT_MODULES`` (i.e. something the candidate defines); comprehensions and lambdas
that need such names are probed whole. An assert with no probe never uses the candidate ("vacuous"):
it is left out of the score.

Tests that are more than one assert statement (the HumanEval ``check(candidate)`` form, or several
statements) are split by program_tests into standalone asserts, judged as above, plus a residual
program for what cannot be split. A residual program passes only when its process exits with a status
drawn per call by the parent and observed by the harness, never on anything the candidate's process
writes; it is still weaker (a candidate that inspects its own process can find the status), so such
tests are counted (``extras["program_tests"]``) and warned about once.
stdin/stdout tests ({"input": ..., "output": ...}) send only the input; the output is compared here
after normalising line endings and trailing whitespace.
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib
import json
import warnings
from typing import Any

from rewards.program_tests import split_program

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


def _compile_assert(src: str, label: str, tree: ast.Module | None = None) -> dict:
    """One ``assert`` statement -> probes for the sandbox + the template judged here."""
    tree = tree or ast.parse(src)
    splitter = _Splitter()
    template = splitter.visit(tree.body[0].test)
    expr = ast.Expression(body=template)
    ast.fix_missing_locations(expr)
    # No probe: the verdict does not depend on anything the candidate defines (e.g. ``assert True``).
    return {"sandbox": {"kind": "probe", "exprs": splitter.probes}, "template": compile(expr, label, "eval"),
            "expected": None, "vacuous": not splitter.probes}


def compile_test(test: Any, index: int) -> list[dict]:
    """One row test -> compiled tests: {"sandbox": harness test, "template"|"expected", "vacuous",
    "program", "split"}. An assert string gives one; a program gives one per standalone assert plus
    one residual program (see program_tests); an {"input", "output"} dict gives one stdio test."""
    if isinstance(test, dict):
        if "input" not in test or "output" not in test:
            raise TestFormatError(f"test {index}: a dict test needs 'input' and 'output' keys, got {sorted(test)}")
        return [{"sandbox": {"kind": "stdio", "stdin": str(test["input"])}, "template": None,
                 "expected": str(test["output"]), "vacuous": False}]
    if not isinstance(test, str):
        raise TestFormatError(f"test {index}: expected an assert string or an input/output dict, "
                              f"got {type(test).__name__}")
    try:
        tree = ast.parse(test.strip())
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
            return [_compile_assert(test, f"<test {index}>", tree)]
        split = split_program(test.strip(), PARENT_MODULES)
    except SyntaxError as e:
        raise TestFormatError(f"test {index}: syntax error in {test[:200]!r}: {e.msg}") from e
    out = [dict(_compile_assert(a, f"<test {index}.{k}>"), split=True) for k, a in enumerate(split.asserts)]
    if split.residual is not None:
        out.append({"sandbox": {"kind": "program", "src": split.residual}, "template": None, "expected": None,
                    "vacuous": split.residual_vacuous, "program": True})
    if not out:  # nothing that can fail (e.g. only imports): one vacuous test, left out of the score
        out.append({"sandbox": {"kind": "program", "src": test}, "template": None, "expected": None,
                    "vacuous": True, "program": True})
    return out


@functools.lru_cache(maxsize=4096)
def _compile_cached(tests_json: str) -> tuple:
    return tuple(c for i, t in enumerate(json.loads(tests_json)) for c in compile_test(t, i))


def compile_tests(tests: list) -> tuple:
    """All of a row's tests compiled once (cached by content); callers must not modify the result."""
    try:
        blob = json.dumps(list(tests), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TestFormatError(f"tests must be JSON data (assert strings / input-output dicts): {e}") from e
    return _compile_cached(blob)


def audit_tests(rows) -> dict:
    """Count a dataset's tests by how they are judged, when it is loaded: ``tests`` (row tests),
    ``scored`` (compiled tests that count), ``probe``, ``stdio``, ``program`` (judged by an exit
    status inside the candidate's process: weaker), ``split`` (asserts taken out of programs),
    ``vacuous`` (never refer to the candidate: left out of the score), ``bad`` (rows whose tests do not
    compile). Warns once when there are program tests."""
    counts = dict.fromkeys(("rows", "tests", "scored", "probe", "stdio", "program", "split", "vacuous", "bad"), 0)
    for row in rows:
        tests = row.get("tests") if isinstance(row, dict) else row
        if not tests:
            continue
        tests = [tests] if isinstance(tests, (str, dict)) else list(tests)
        counts["rows"] += 1
        counts["tests"] += len(tests)
        try:
            compiled = compile_tests(tests)
        except TestFormatError:
            counts["bad"] += 1
            continue
        for c in compiled:
            if c.get("vacuous"):
                counts["vacuous"] += 1
                continue
            counts["scored"] += 1
            counts[c["sandbox"]["kind"]] += 1
            counts["split"] += bool(c.get("split"))
    if counts["program"]:
        warn_program_tests(counts["program"], counts["scored"])
    return counts


_WARNED: set = set()


def warn_program_tests(n_program: int, n_scored: int, where: str = "in this data") -> None:
    """Say once per process that some tests are programs judged inside the candidate's process."""
    if "program" in _WARNED:
        return
    _WARNED.add("program")
    msg = (f"code reward: {n_program} of {n_scored} tests {where} are programs that could not be split into "
           "assert probes; they pass on an exit status chosen per call, observed by the harness, but a hostile "
           "completion that inspects its own process can still forge it (counted in extras['program_tests'] "
           "and RewardWorker.stats()['reward/program_tests']; see docs/rewards.md)")
    warnings.warn(msg, stacklevel=2)


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


def _parent_scope() -> dict:
    return {m: importlib.import_module(m) for m in PARENT_MODULES}


def _judge_values(compiled: dict, record: dict) -> tuple[bool, str]:
    """Probe test: parse the child's payload (candidate-written bytes) and evaluate the template."""
    try:
        payload = json.loads(record.get("payload") or "")
    except (ValueError, TypeError, RecursionError):
        return False, "bad_record"
    if not isinstance(payload, dict):
        return False, "bad_record"
    if "error" in payload:
        return False, f"raised:{str(payload['error'])[:40]}"
    values = payload.get("values")
    if not isinstance(values, list) or len(values) != len(compiled["sandbox"]["exprs"]):
        return False, "bad_record"
    try:
        decoded = [decode(v) for v in values]
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError):
        return False, "bad_value"
    scope = _parent_scope()
    scope.update({f"__p{i}": v for i, v in enumerate(decoded)})
    try:
        ok = bool(eval(compiled["template"], {"__builtins__": builtins}, scope))
    except Exception as e:
        return False, f"assert_raised:{type(e).__name__}"
    return ok, "ok" if ok else "assert_failed"


def judge(compiled: dict, record: dict | None, exit_code: int | None = None) -> tuple[bool, str]:
    """Verdict for one test from the harness record (None: the harness died first). Runs in the parent.
    ``exit_code``: the status a program test must exit with (drawn per call). Whatever the record holds,
    the answer is a verdict, never an exception."""
    try:
        if not isinstance(record, dict):
            return False, "no_record"
        if record.get("status") != "ok":
            return False, str(record.get("status"))[:40]
        kind = compiled["sandbox"]["kind"]
        if kind == "stdio":
            if record.get("exit") != 0:
                return False, "nonzero_exit"
            ok = _normalize_output(str(record.get("stdout", ""))) == _normalize_output(compiled["expected"])
            return ok, "ok" if ok else "wrong_output"
        if kind == "program":
            ok = exit_code is not None and record.get("exit") == exit_code
            return ok, "ok" if ok else "program_failed"
        return _judge_values(compiled, record)
    except Exception as e:  # a record we did not foresee is still only a failed test
        return False, f"bad_record:{type(e).__name__}"
