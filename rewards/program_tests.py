"""Split program-form tests into independent assert tests, and find tests that never use the candidate.

A *program* test is a test string that is more than one ``assert`` statement, typically the HumanEval
form::

    METADATA = {...}
    def check(candidate):
        assert candidate([1, 2]) == 3
        assert True, "..."
    check(entry_point)

Run whole it would be one test, all or nothing. ``split_program`` turns every ``assert`` that stands
alone into its own assert test (``candidate`` renamed to the entry point, module-level immutable constants
inlined), so a problem scores the fraction of its asserts that pass. An assert stands alone when it uses
no name the program binds (other than those constants and ``import math``-style imports of the modules
the judge preloads) and binds nothing itself. What is left (loops, helper variables, statements with
side effects) stays one *residual* program. All of them run in the judge, outside the sandbox, alike.

A test is *vacuous* when nothing in it refers to a name the candidate defines (``assert True``,
``assert 1 == 1``): it cannot tell a right answer from a wrong one, so it is left out of the score.
"""
from __future__ import annotations

import ast
import builtins
import copy
import dataclasses

_BUILTIN_NAMES = set(dir(builtins))
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None))


@dataclasses.dataclass
class Split:
    """``asserts``: standalone assert sources; ``residual``: the rest as one program (None when nothing
    that can fail is left); ``residual_vacuous``: the residual never refers to the candidate."""

    asserts: list
    residual: str | None
    residual_vacuous: bool = False


def _binds(n: ast.AST) -> list:
    """Names this one node binds (not its children)."""
    if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
        return [n.id]
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [n.name]
    if isinstance(n, ast.arg):
        return [n.arg]
    if isinstance(n, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in n.names]
    if isinstance(n, ast.ExceptHandler) and n.name:
        return [n.name]
    name = getattr(n, "name", None) if type(n).__name__ in ("MatchAs", "MatchStar") else getattr(n, "rest", None) \
        if type(n).__name__ == "MatchMapping" else None
    return [name] if name else []


def bound_names(node: ast.AST) -> set[str]:
    """Every name a piece of code binds anywhere (assignments, defs, imports, parameters, loop and
    comprehension targets, except/match captures); scope-insensitive on purpose (conservative)."""
    return {name for n in ast.walk(node) for name in _binds(n)}


def free_names(node: ast.AST) -> set[str]:
    """Names read but bound neither in ``node`` nor in builtins: what the code needs from outside."""
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - bound_names(node) - _BUILTIN_NAMES


def is_vacuous_program(src: str) -> bool:
    """True when the program refers to nothing it does not define itself (it never uses the candidate)."""
    try:
        return not free_names(ast.parse(src))
    except SyntaxError:
        return False


def _humaneval_parts(tree: ast.Module):
    """(check FunctionDef, its parameter name, the entry point name, the call statement) or None."""
    checks = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    calls = [s for s in tree.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
             and isinstance(s.value.func, ast.Name) and s.value.func.id == "check"]
    if len(checks) != 1 or len(calls) != 1:
        return None
    fn, call = checks[0], calls[0].value
    params = fn.args.posonlyargs + fn.args.args
    if (len(params) != 1 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.decorator_list
            or len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Name)):
        return None
    return fn, params[0].arg, call.args[0].id, calls[0]


def _constants(tree: ast.Module, body: list) -> dict:
    """Module-level names bound exactly once in the program to an immutable literal: name -> AST."""
    counts: dict = {}
    for n in ast.walk(tree):
        for name in _binds(n):  # a def/import/parameter of that name counts double: never a constant
            counts[name] = counts.get(name, 0) + (1 if isinstance(n, ast.Name) else 2)
    out = {}
    for s in body:
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            try:
                value = ast.literal_eval(s.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if _immutable(value) and counts.get(s.targets[0].id) == 1:
                out[s.targets[0].id] = s.value
    return out


def _immutable(v) -> bool:
    if isinstance(v, tuple):
        return all(_immutable(x) for x in v)
    return isinstance(v, _IMMUTABLE)


class _Rewrite(ast.NodeTransformer):
    """Rename the check parameter to the entry point and inline constants."""

    def __init__(self, rename: dict, constants: dict):
        self.rename, self.constants = rename, constants

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.constants:
            return ast.copy_location(copy.deepcopy(self.constants[node.id]), node)
        if node.id in self.rename:
            return ast.copy_location(ast.Name(id=self.rename[node.id], ctx=node.ctx), node)
        return node


def _standalone(stmt: ast.stmt, rewrite: _Rewrite, others_bound: set, parent_modules: tuple,
                entry: str | None) -> str | None:
    """The assert as a standalone source when it needs nothing the program binds, else None."""
    if not isinstance(stmt, ast.Assert) or any(isinstance(n, ast.NamedExpr) for n in ast.walk(stmt)):
        return None
    test = rewrite.visit(copy.deepcopy(stmt.test))
    needs = free_names(test)
    allowed = set(parent_modules) | ({entry} if entry else set())
    if (needs & others_bound) - allowed:
        return None
    if entry in _BUILTIN_NAMES:  # the splitter would take the candidate's function for the builtin
        return None
    return ast.unparse(ast.Assert(test=test, msg=None))


def _tests_something(stmts: list) -> bool:
    return any(isinstance(n, (ast.Assert, ast.Raise, ast.Call)) for s in stmts for n in ast.walk(s))


def _bound_imports(stmts: list, parent_modules: tuple) -> set:
    """Names bound by ``import m`` of a module the parent also evaluates with (same object both sides)."""
    out = set()
    for s in stmts:
        if isinstance(s, ast.Import):
            out |= {a.name for a in s.names if a.asname is None and a.name in parent_modules}
    return out


def split_program(src: str, parent_modules: tuple) -> Split:
    """Split a program test (see the module docstring). Raises SyntaxError on unparsable source."""
    tree = ast.parse(src)
    he = _humaneval_parts(tree)
    if he:
        fn, param, entry, call_stmt = he
        prelude = [s for s in tree.body if s is not fn and s is not call_stmt]
        body, rename = fn.body, {param: entry}
    else:
        prelude, body, rename, entry = [], tree.body, {}, None
    constants = _constants(tree, prelude if he else tree.body)
    imports = _bound_imports(prelude + body, parent_modules)
    rewrite = _Rewrite(rename, constants)
    asserts, residual = [], []
    for stmt in body:
        others = bound_names(ast.Module(body=prelude + [s for s in body if s is not stmt], type_ignores=[]))
        others = (others | set(rename)) - set(constants) - imports
        one = _standalone(stmt, rewrite, others, parent_modules, entry)
        if one is not None:
            asserts.append(one)
        elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):  # docstrings
            residual.append(stmt)
    if not _tests_something(residual):
        return Split(asserts, None)
    if he:
        kept = copy.deepcopy(fn)
        kept.body = residual
        program = ast.Module(body=[s if s is not fn else kept for s in tree.body], type_ignores=[])
        # vacuous unless the residual check body or the prelude refers to something the candidate defines
        probe = _Rewrite(rename, {}).visit(ast.Module(body=copy.deepcopy(prelude + residual), type_ignores=[]))
        vacuous = not free_names(probe)
    else:
        program = ast.Module(body=residual, type_ignores=[])
        vacuous = not free_names(program)
    return Split(asserts, ast.unparse(ast.fix_missing_locations(program)), vacuous)
