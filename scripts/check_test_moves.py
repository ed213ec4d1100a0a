#!/usr/bin/env python3
"""Check that moving tests between files lost or changed none: every test function of tests/ at a git revision
must exist in the working tree with the same code.

    python scripts/check_test_moves.py                       # against the default revision, all of tests/
    python scripts/check_test_moves.py 9396ec6 --under tests/rollout

A test function (`test_*`, at module level or in a `Test*` class) of the old tree is found when some file under
tests/ now has a test function whose code is the same: the same decorators (so the same parametrisation),
arguments and body, compared as ASTs (formatting, comments and line numbers do not count). Two differences are
allowed and reported: the name may have lost a work-item number (`test_x_mut40` -> `test_x`), and the docstring
may differ (a sentence naming the work item dropped). A module-level name that a merge had to rename (two files
each with its own `PROMPTS`) is given as `--alias NEW=OLD`: NEW in today's tests reads as OLD, and the tests that
use it are reported as `aliased`. A test whose name is found but whose code differs is `changed`; one found nowhere
is `lost`. The exit status is 1 when any is lost or changed.
"""
from __future__ import annotations

import argparse
import ast
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the commit before tests/rollout's work-item files were merged into their modules' files
DEFAULT_REV = "e96b16d"
WORK_ITEM = re.compile(r"_(mut|mt|dev)\d+(?=_|$)|_\d{2,}$")


def plain_name(name: str) -> str:
    """The name without a work-item number: test_x_mut40 -> test_x, test_y_mt40_z -> test_y_z."""
    return WORK_ITEM.sub("", name)


class _Alias(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names, self.used = names, False

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.names:
            self.used = True
            return ast.copy_location(ast.Name(id=self.names[node.id], ctx=node.ctx), node)
        return node


def _code(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's decorators, arguments and body without its docstring, as an AST dump (no positions)."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ast.dump(ast.Module(body=[*fn.decorator_list, fn.args, *body], type_ignores=[]))


def test_functions(source: str, alias: dict[str, str] | None = None) -> list[tuple[str, str, str | None, bool]]:
    """(qualified name, code, docstring, whether an alias was applied) of each test function of one file: `test_f`
    or `TestC.test_f`; `alias` maps names of the code to the names they stand for."""
    out = []
    tree = ast.parse(source)
    renamer = _Alias(alias or {})
    for node in tree.body:
        scopes = [("", node)]
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            scopes = [(node.name + ".", n) for n in node.body]
        for prefix, fn in scopes:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
                renamer.used = False
                fn = renamer.visit(fn)
                out.append((prefix + fn.name, _code(fn), ast.get_docstring(fn), renamer.used))
    return out


def files_at(rev: str, under: str) -> dict[str, str]:
    """{path: text} of the .py files under `under` at git revision `rev`."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", under], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for n in names if n.endswith(".py")}


def files_now(under: str) -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / under).rglob("*.py"))}


def compare(old: dict[str, str], new: dict[str, str], alias: dict[str, str] | None = None
            ) -> dict[str, list[tuple[str, str, str]]]:
    """{outcome: [(old path, old name, where now)]}; outcomes: same, renamed, docstring, aliased, changed, lost.

    A test is matched by (plain name, code) anywhere in `new`; failing that, by its plain name alone (changed)."""
    by_code, by_name = {}, collections.defaultdict(list)
    for path, text in new.items():
        for name, code, doc, aliased in test_functions(text, alias):
            short = name.rsplit(".", 1)[-1]
            by_code.setdefault((plain_name(short), code), []).append((path, name, doc, aliased))
            by_name[plain_name(short)].append((path, name))
    out = collections.defaultdict(list)
    for path, text in sorted(old.items()):
        for name, code, doc, _ in test_functions(text):
            short = name.rsplit(".", 1)[-1]
            hits = by_code.get((plain_name(short), code))
            if hits:
                same_doc = [h for h in hits if h[2] == doc]
                new_path, new_name, _, aliased = (same_doc or hits)[0]
                where = f"{new_path}::{new_name}"
                kind = "same" if new_name.rsplit(".", 1)[-1] == short else "renamed"
                kind = kind if same_doc else "docstring"
                out["aliased" if aliased else kind].append((path, name, where))
            elif by_name.get(plain_name(short)):
                out["changed"].append((path, name, ", ".join(f"{p}::{n}" for p, n in by_name[plain_name(short)])))
            else:
                out["lost"].append((path, name, "-"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", nargs="?", default=DEFAULT_REV, help=f"git revision (default {DEFAULT_REV})")
    ap.add_argument("--under", default="tests", help="the old tree's folder whose tests are checked (default tests)")
    ap.add_argument("--alias", nargs="*", default=[], metavar="NEW=OLD",
                    help="a module-level name renamed by a merge: NEW now reads as OLD")
    args = ap.parse_args(argv)
    alias = dict(a.split("=", 1) for a in args.alias)
    old, new = files_at(args.rev, args.under), files_now("tests")
    out = compare(old, new, alias)
    total = sum(len(v) for v in out.values())
    print(f"{total} test functions under {args.under} at {args.rev}, looked for in tests/ now:")
    for kind in ("same", "renamed", "docstring", "aliased", "changed", "lost"):
        print(f"  {kind}: {len(out[kind])}")
    for kind in ("renamed", "docstring", "aliased", "changed", "lost"):
        for path, name, where in out[kind]:
            print(f"{kind}: {path}::{name} -> {where}")
    return 1 if out["changed"] or out["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
