"""docs/architecture.md names every public module of ebpo/, rollout/, rewards/ and kernels/."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def public_modules() -> list[str]:
    """Repository-relative paths of the packages' modules whose name does not start with an underscore."""
    out = []
    for pkg in ("ebpo", "rollout", "rewards", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if not path.name.startswith("_") and "assets" not in rel.parts:
                out.append(rel.as_posix())
    return out


def test_architecture_doc_lists_every_public_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = public_modules()
    assert len(modules) > 80
    missing = [m for m in modules if f"`{m}`" not in doc]
    assert not missing, f"docs/architecture.md does not list {missing}"


def test_the_doc_lists_no_module_that_does_not_exist():
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:ebpo|rollout|rewards|kernels)/[\w/]+\.py)`", doc))
    assert not [m for m in named if not (ROOT / m).exists()]
