"""The lock and what the project says about it agree."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lock() -> dict[str, str]:
    pairs = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "requirements" / "lock.txt").read_text(), re.M)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pairs}


def test_the_documented_tested_versions_are_the_locked_ones():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    header, _, values = re.search(r"\| torch \| transformers .*\n\|[-|]+\n.*", text).group(0).partition("\n|---")
    names = [c.strip() for c in header.strip("|").split("|")]
    versions = [c.strip() for c in values.splitlines()[-1].strip("|").split("|")]
    lock = _lock()
    assert {n: lock[n] for n in names} == dict(zip(names, versions))


def test_every_dependency_of_pyproject_is_locked_and_inside_its_range():
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = _lock()
    extras = project["optional-dependencies"]
    for spec in project["dependencies"] + extras["test"] + extras["docs"]:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in lock, f"{name} is a dependency but not in requirements/lock.txt: run scripts/lock.sh"
        assert req.specifier.contains(lock[name], prereleases=True), f"{name}=={lock[name]} is outside {req.specifier}"


def test_the_lock_pins_versions_only_never_a_path_or_the_project_itself():
    lines = [line for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    bad = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9_.-]+==[^\s@+]+", line)
           or re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() == "ebpo"]
    assert not bad, f"requirements/lock.txt must hold name==version lines only: {bad}"
