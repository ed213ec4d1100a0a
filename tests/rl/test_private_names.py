"""The learner's private names stay inside `ebpo/rl/learner*.py`, and no module of ours imports another
module's private name: other modules go through a public API (read from the source, no import)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ebpo", "rollout", "rewards", "kernels")
LEARNER_NAMES = {"learner", "lrn", "self.learner", "run.learner", "trainer.learner"}


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "assets" not in path.parts:
                yield path, ast.parse(path.read_text(), str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_outside_the_learner_touches_a_learner_private_name():
    bad = []
    for path, tree in _sources():
        rel = path.relative_to(ROOT)
        if rel.parent == Path("ebpo/rl") and rel.name.startswith("learner"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and ast.unparse(node.value) in LEARNER_NAMES:
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "private learner names used outside ebpo/rl/learner*.py:\n" + "\n".join(bad)


def test_no_module_imports_a_private_name_of_another_module():
    bad = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                for alias in node.names:
                    if _private(alias.name):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
