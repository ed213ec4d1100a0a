"""Helpers that a task's prompt defines: trusted task code, bound in the judge from the prompt.

A code task's prompt often defines functions besides the one to write (HumanEval/32 gives ``poly`` and
asks for ``find_zero``; /38 and /50 give ``encode_cyclic`` / ``encode_shift`` and ask for the decoder),
and its tests call them to build inputs or check outputs. If the judge took those names from the
candidate, a candidate could redefine the helper and the function together (two identity functions) and
pass. So a name the prompt defines in full is bound in the judge to the prompt's definition, run there
with the tests; only the names the prompt leaves to be written come from the candidate.

What counts as the prompt's code: the whole prompt when it parses as Python, else every fenced block of
it that parses, else the text from its first line that starts a definition or an import to the end.
What counts as a helper: a top-level function or class with a body (more than a docstring, ``pass``,
``...``, imports or a ``raise``), or a top-level assignment, and never the test's entry point
(``check(entry_point)``). Helpers are trusted only when the prompt also leaves something to be written
(a stub, or the entry point undefined): a prompt that gives a complete program ("fix this function")
defines nothing the candidate should not.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re

from rewards.format_reward import code_blocks

_START = re.compile(r"^(?:def |class |import |from |async def |@)", re.M)


@dataclasses.dataclass(frozen=True)
class PromptHelpers:
    """``src``: what the judge runs before a test that needs one of ``names`` (the prompt's imports,
    each made optional, then its helper definitions); ``names``: what the prompt defines in full;
    ``stubs``: what it leaves to be written."""

    src: str = ""
    names: frozenset = frozenset()
    stubs: frozenset = frozenset()

    def for_entry(self, entry: str | None) -> frozenset:
        """The helper names to bind from the prompt for a test whose entry point is ``entry`` (None when
        the test names none): empty when the prompt leaves nothing to be written."""
        names = self.names - {entry} if entry else self.names
        if not (self.stubs or (entry and entry not in self.names)):
            return frozenset()
        return frozenset(names)


NONE = PromptHelpers()


def _is_stub(node: ast.AST) -> bool:
    """A definition whose body only documents what to write (docstring, pass, ..., imports, raise)."""
    for s in node.body:
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
            continue
        if not isinstance(s, (ast.Pass, ast.Import, ast.ImportFrom, ast.Raise)):
            return False
    return True


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def _modules(prompt: str) -> list[ast.Module]:
    whole = _parse(prompt)
    if whole is not None:
        return [whole]
    blocks = [t for t in (_parse(body) for _, body in code_blocks(prompt)) if t is not None]
    if blocks:
        return blocks
    m = _START.search(prompt)
    tail = _parse(prompt[m.start():]) if m else None
    return [tail] if tail is not None else []


def _optional_import(stmt: ast.stmt) -> ast.stmt:
    """``try: <import> / except ImportError: pass``: a module the judge lacks fails only what uses it."""
    handler = ast.ExceptHandler(type=ast.Name(id="ImportError", ctx=ast.Load()), name=None, body=[ast.Pass()])
    return ast.Try(body=[stmt], handlers=[handler], orelse=[], finalbody=[])


@functools.lru_cache(maxsize=4096)
def prompt_helpers(prompt: str | None) -> PromptHelpers:
    """The helpers ``prompt`` defines (see the module docstring); NONE when it defines none."""
    if not prompt or not isinstance(prompt, str):
        return NONE
    kept, names, stubs = [], set(), set()
    for tree in _modules(prompt):
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                kept.append(_optional_import(stmt))
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _is_stub(stmt):
                    stubs.add(stmt.name)
                else:
                    kept.append(stmt)
                    names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if all(isinstance(t, ast.Name) for t in targets):
                    kept.append(stmt)
                    names.update(t.id for t in targets)
    names -= stubs  # defined twice, once as a stub: left to the candidate
    kept = [s for s in kept if getattr(s, "name", None) not in stubs]
    if not names:
        return NONE
    src = ast.unparse(ast.fix_missing_locations(ast.Module(body=kept, type_ignores=[])))
    try:
        compile(src, "<prompt helpers>", "exec")
    except (SyntaxError, ValueError):
        return NONE
    return PromptHelpers(src, frozenset(names), frozenset(stubs))
