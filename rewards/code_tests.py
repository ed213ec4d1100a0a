"""Compile a row's tests into what the judge runs: test code, and the names it needs from the candidate.

Every test runs outside the sandbox, in one of the judge's confined test runners (``_judge.py``,
``_judge_runner.py``), with the judge's own builtins; each name it needs that the candidate defines (a
free name that is neither a builtin nor one of ``PARENT_MODULES``) is bound to what the candidate
reports for it: a plain value, or a proxy that
calls the candidate in the sandbox with plain-data arguments and returns its plain-data answer. So
``assert f(x) == y``, ``assert all([f(a) == b for a, b in cases])`` and HumanEval's
``check(candidate)`` programs all compare plain values in the judge: an object with a lying ``__eq__``
never reaches it, a module-level ``range`` or ``len`` of the candidate's never changes what the test's
names mean, and no pass status lives where the candidate runs.

Program tests (more than one assert statement, e.g. HumanEval's ``check``) are split by program_tests
into standalone asserts, one test each (a problem scores the fraction of its asserts that pass), plus one
residual program for what cannot be split; all run in the judge alike. A test that never refers to the
candidate is *vacuous* and left out of the score. A test that needs the candidate as more than a value
or a function to call (``f.__name__``, ``inspect.getsource(f)``) cannot run across the channel: it is
*unsupported*, reported when the tests are compiled (``audit_tests`` counts and warns at load time) and
scored as a failed test, never judged with a weaker boundary. stdin/stdout tests ({"input", "output"})
send only the input into the sandbox; the output is compared in the judge after normalising line endings
and trailing whitespace.
"""
from __future__ import annotations

import ast
import builtins
import functools
import json
import warnings
from typing import Any

from rewards._plain import plain_encode
from rewards.program_tests import free_names, split_program
from rewards.prompt_helpers import NONE, PromptHelpers, prompt_helpers

PARENT_MODULES = ("math", "cmath", "re", "string", "itertools", "functools", "collections", "heapq",
                  "bisect", "fractions", "decimal", "statistics", "operator")
_BUILTIN_NAMES = set(dir(builtins))
# names whose use means the test looks at the candidate's code rather than calling it
_INTROSPECTION = {"inspect", "dis", "getsource", "__code__", "__globals__", "__closure__", "__defaults__",
                  "co_code", "__wrapped__"}


class TestFormatError(ValueError):
    """A test that is neither an assert/exec string nor an {"input", "output"} dict."""


def candidate_names(tree: ast.AST) -> list[str]:
    """Names the test reads and neither binds nor finds among the builtins or PARENT_MODULES, plus the
    argument of a top-level ``check(name)`` call (HumanEval: the entry point, even one named like a
    builtin): what the judge asks the candidate for."""
    names = free_names(tree) - set(PARENT_MODULES)
    for stmt in getattr(tree, "body", []):
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id == "check" and len(stmt.value.args) == 1
                and isinstance(stmt.value.args[0], ast.Name)):
            names.add(stmt.value.args[0].id)
    return sorted(names)


def _introspects(tree: ast.AST, names: list[str]) -> bool:
    """True when the test reads an attribute of a candidate name or uses introspection."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and (n.attr in _INTROSPECTION or
                                             (isinstance(n.value, ast.Name) and n.value.id in names)):
            return True
        if isinstance(n, ast.Name) and n.id in _INTROSPECTION:
            return True
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any(
                a.name.split(".")[0] in _INTROSPECTION for a in n.names):
            return True
    return False


def first_call(tree: ast.Module, names: list[str]) -> dict | None:
    """The one call a single-assert test makes to the candidate when its arguments are literals
    (``assert add(2, 3) == 5``), as a plain-data request: the judge sends it with the test's start, so
    its answer is ready when the test asks (the candidate's process runs one test only, so calling it
    early changes nothing the test can see). None for anything else."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in names]
    if len(uses) != 1 or len(calls) != 1 or any(isinstance(n, (ast.Lambda, ast.comprehension)) for n in ast.walk(tree)):
        return None
    call = calls[0]
    try:
        args = [ast.literal_eval(a) for a in call.args]  # a *starred argument is not a literal
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        if len(kwargs) != len(call.keywords):
            return None
        return {"name": call.func.id, "args": plain_encode(args), "kwargs": plain_encode(kwargs)}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # PlainError is a ValueError
        return None


def _entry_point(tree: ast.Module) -> str | None:
    """The argument of a top-level ``check(name)`` call (HumanEval's entry point), else None."""
    for stmt in tree.body:
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id == "check" and len(stmt.value.args) == 1
                and isinstance(stmt.value.args[0], ast.Name)):
            return stmt.value.args[0].id
    return None


def _compile_code(src: str, label: str, helpers: PromptHelpers = NONE, trusted: frozenset = frozenset(),
                  **flags) -> dict:
    """One test for the judge. Names in ``trusted`` (helpers the prompt defines) are bound from the
    prompt's code (``prelude``, run in the judge before the test) and never asked of the candidate."""
    tree = ast.parse(src)
    names = candidate_names(tree)
    from_prompt = [n for n in names if n in trusted]
    names = [n for n in names if n not in trusted]
    compile(tree, label, "exec")  # a syntax error the parser let through shows here, not in the judge
    judge = {"kind": "call", "src": src, "names": names}
    if from_prompt:
        judge["prelude"] = helpers.src
    first = first_call(tree, names)
    if first:
        judge["first"] = first
    return {"judge": judge, "vacuous": not names, "unsupported": bool(names) and _introspects(tree, names), **flags}


def compile_test(test: Any, index: int, helpers: PromptHelpers = NONE) -> list[dict]:
    """One row test -> compiled tests: {"judge": what the judge runs, "vacuous", "unsupported",
    "program", "split"}. An assert string gives one; a program gives one per standalone assert plus one
    residual program (see program_tests); an {"input", "output"} dict gives one stdio test. ``helpers``:
    what the task's prompt defines (prompt_helpers), bound from the prompt, never from the candidate."""
    if isinstance(test, dict):
        if "input" not in test or "output" not in test:
            raise TestFormatError(f"test {index}: a dict test needs 'input' and 'output' keys, got {sorted(test)}")
        return [{"judge": {"kind": "stdio", "stdin": str(test["input"]), "expected": str(test["output"])},
                 "vacuous": False, "unsupported": False}]
    if not isinstance(test, str):
        raise TestFormatError(f"test {index}: expected an assert string or an input/output dict, "
                              f"got {type(test).__name__}")
    try:
        tree = ast.parse(test.strip())
        trusted = helpers.for_entry(_entry_point(tree))
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
            return [_compile_code(test.strip(), f"<test {index}>", helpers, trusted)]
        split = split_program(test.strip(), PARENT_MODULES)
        out = [_compile_code(a, f"<test {index}.{k}>", helpers, trusted, split=True)
               for k, a in enumerate(split.asserts)]
        if split.residual is not None:
            out.append(_compile_code(split.residual, f"<test {index}>", helpers, trusted, program=True))
    except SyntaxError as e:
        raise TestFormatError(f"test {index}: syntax error in {test[:200]!r}: {e.msg}") from e
    if not out:  # nothing that can fail (e.g. only imports): one vacuous test, left out of the score
        out.append({"judge": {"kind": "call", "src": test, "names": []}, "vacuous": True, "unsupported": False,
                    "program": True})
    return out


@functools.lru_cache(maxsize=4096)
def _compile_cached(tests_json: str, helpers: PromptHelpers) -> tuple:
    return tuple(c for i, t in enumerate(json.loads(tests_json)) for c in compile_test(t, i, helpers))


def compile_tests(tests: list, prompt: str | None = None) -> tuple:
    """All of a row's tests compiled once (cached by content); callers must not modify the result.
    ``prompt``: the task's prompt, whose helper definitions the tests get (see prompt_helpers)."""
    try:
        blob = json.dumps(list(tests), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TestFormatError(f"tests must be JSON data (assert strings / input-output dicts): {e}") from e
    return _compile_cached(blob, prompt_helpers(prompt))


def audit_tests(rows) -> dict:
    """Count a dataset's tests by how they are judged, when it is loaded: ``tests`` (row tests),
    ``scored`` (compiled tests that count), ``assert``, ``stdio``, ``program`` (residual programs),
    ``split`` (asserts taken out of programs), ``vacuous`` (never refer to the candidate: left out of the
    score), ``unsupported`` (need the candidate as more than values and calls: they always fail),
    ``bad`` (rows whose tests do not compile). Warns once when some tests are unsupported."""
    keys = ("rows", "tests", "scored", "assert", "stdio", "program", "split", "vacuous", "unsupported", "bad")
    counts = dict.fromkeys(keys, 0)
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
            counts["unsupported"] += bool(c.get("unsupported"))
            kind = "stdio" if c["judge"]["kind"] == "stdio" else "program" if c.get("program") else "assert"
            counts[kind] += 1
            counts["split"] += bool(c.get("split"))
    if counts["unsupported"]:
        warn_unsupported_tests(counts["unsupported"], counts["scored"])
    return counts


_WARNED: set = set()


def warn_unsupported_tests(n: int, n_scored: int, where: str = "in this data") -> None:
    """Say once per process, loudly, that some tests cannot be judged across the channel."""
    if "unsupported" in _WARNED:
        return
    _WARNED.add("unsupported")
    warnings.warn(f"code reward: {n} of {n_scored} tests {where} use the candidate as more than values and "
                  "calls (attributes of its names, introspection of its code); the judge cannot run them "
                  "across the plain-data channel, so they always fail (counted in extras['unsupported_tests'] "
                  "and RewardWorker.stats()['reward/unsupported_tests']; see docs/rewards.md)", stacklevel=2)
