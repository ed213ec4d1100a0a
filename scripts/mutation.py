#!/usr/bin/env python3
"""Mutation testing (mutmut) of chosen modules against their mirrored test folders; writes a report.

    python scripts/mutation.py ebpo/rl/records.py ebpo/rl/weights.py
    python scripts/mutation.py --tests tests/levenshtein ebpo/core/levenshtein.py
    python scripts/mutation.py --report-only --workdir /tmp/ebpo-mutation   # the report of a finished run

Each module's tests are its mirrored folder (ebpo/core/x.py -> tests/core and tests/levenshtein, ebpo/rl/x.py ->
tests/rl, rewards/x.py -> tests/rewards, rollout/x.py -> tests/rollout) unless `--tests` names others. The
run works on a copy of the working tree (tracked and untracked, not ignored files) in `--workdir`, so the
tree is never mutated and other work may go on in it meanwhile; mutmut runs there with `--jobs` workers
(1 by default: it is CPU heavy) and runs, for each mutant, only the tests that executed the mutated function.
The report (`--out`, default docs/mutation/REPORT.md) gives killed / survived / timeout / no tests per module,
the score (killed + timeout over all mutants, and over the mutants not judged equivalent), and every
survivor with its diff; docs/mutation/equivalent.txt lists the survivors judged equivalent
(`mutant-name  reason`, one a line), which the report marks. When to run it: README, "Development".
"""
from __future__ import annotations

import argparse
import collections
import datetime
import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIRRORS = {"ebpo/core/": ["tests/core", "tests/levenshtein"], "ebpo/rl/": ["tests/rl"], "rewards/": ["tests/rewards"],
           "rollout/": ["tests/rollout"], "ebpo/model/": ["tests/model"], "ebpo/infra/": ["tests/infra"],
           "ebpo/sft/": ["tests/sft"]}
SOURCE_PATHS = ["ebpo", "rollout", "rewards", "kernels"]
KILLED = ("killed", "timeout", "caught by type check")


def mirrored_tests(module: str) -> list[str]:
    for prefix, tests in MIRRORS.items():
        if module.startswith(prefix):
            return tests
    raise SystemExit(f"mutation.py: no mirrored test folder known for {module}; name them with --tests")


def copy_tree(dest: Path) -> None:
    """The working tree as it is now (tracked + untracked, not ignored), into `dest`."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def configure(work: Path, modules: list[str], tests: list[str], extra_pytest: list[str],
              timeout_multiplier: float | None = None) -> None:
    py = work / "pyproject.toml"
    text = re.sub(r"\n\[tool\.mutmut\].*?(?=\n\[|\Z)", "\n", py.read_text(), flags=re.S)
    # mutmut runs the tests in work/mutants/: everything else the tests read (recipes, examples, docs) goes too
    also = sorted(p.name for p in work.iterdir() if p.name not in SOURCE_PATHS + ["mutants", "tests", ".git"])
    text += ("\n[tool.mutmut]\n"
             f"source_paths = {toml_list(SOURCE_PATHS)}\n"
             f"also_copy = {toml_list(also)}\n"
             f"only_mutate = {toml_list(modules)}\n"
             f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
             f"pytest_add_cli_args = {toml_list(['-p', 'no:cacheprovider', '-p', 'no:randomly'] + extra_pytest)}\n"
             "use_git_change_detection = false\n"
             + (f"timeout_multiplier = {timeout_multiplier}\n" if timeout_multiplier else ""))
    py.write_text(text)


def results(work: Path) -> dict[str, str]:
    out = subprocess.run(["mutmut", "results", "--all", "true"], cwd=work, capture_output=True, text=True).stdout
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\S+): (.+)$", out, re.M)}


def module_of(mutant: str, modules: list[str]) -> str:
    dotted = {m[:-3].replace("/", "."): m for m in modules}
    for d in sorted(dotted, key=len, reverse=True):
        if mutant.startswith(d + "."):
            return dotted[d]
    return "?"


def equivalents(path: Path) -> dict[str, str]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, _, why = line.strip().partition(" ")
                out[name] = why.strip()
    return out


def selected(by_name: dict, only: list[str] | None) -> dict:
    """The entries of `by_name` (mutant name -> anything) whose names match one of the fnmatch patterns `only`
    (all of them when `only` is empty): what a run of some mutants (`--only`) reports on."""
    if not only:
        return dict(by_name)
    return {n: v for n, v in by_name.items() if any(fnmatch.fnmatchcase(n, pat) for pat in only)}


def stale_equivalents(status: dict[str, str], equiv: dict[str, str], modules: list[str]) -> dict[str, list[str]]:
    """Per module, the equivalent.txt entries of that module that no longer name a survivor of this run: the
    mutant was killed, or no mutant has that name (mutmut numbers mutants within a function, so a changed function
    renumbers them). Each needs re-judging or removing: a stale entry would mark an unrelated mutant."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for name in sorted(equiv):
        mod = module_of(name, modules)
        if mod == "?":
            continue
        st = status.get(name)
        if st is None:
            out[mod].append(f"`{name}`: no such mutant in this run")
        elif st in KILLED:
            out[mod].append(f"`{name}`: {st} in this run")
    return dict(out)


def report(work: Path, modules: list[str], tests: dict[str, list[str]], out: Path, equiv_file: Path,
           minutes: float | None, command: str, only: list[str] | None = None) -> str:
    status = selected(results(work), only)
    equiv = equivalents(equiv_file)
    per = collections.defaultdict(collections.Counter)
    survivors = collections.defaultdict(list)
    for name, st in sorted(status.items()):
        mod = module_of(name, modules)
        per[mod][st] += 1
        if st not in KILLED:
            survivors[mod].append(name)
    lines = [f"# Mutation report ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `{command}`" + (f" ({minutes:.0f} min)" if minutes else ""), "",
             "mutmut " + subprocess.run(["mutmut", "--version"], cwd=work, capture_output=True, text=True).stdout.strip()
             .replace("mutmut, version ", ""), "",
             "Score = (killed + timeout) / mutants; the last column leaves out the survivors judged equivalent "
             "(docs/mutation/equivalent.txt, reasons below). `no tests`: no test of the module's folders ran the "
             "mutated function.", "",
             "| module | tests | mutants | killed | timeout | survived | no tests | other | score | score w/o equivalent |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mod in modules:
        c = per.get(mod, collections.Counter())
        n = sum(c.values())
        killed = c["killed"] + c["caught by type check"]
        other = n - killed - c["timeout"] - c["survived"] - c["no tests"]
        eq = sum(1 for s in survivors.get(mod, []) if s in equiv)
        score = f"{100 * (killed + c['timeout']) / n:.1f}%" if n else "not run"
        score_eq = f"{100 * (killed + c['timeout']) / (n - eq):.1f}%" if n - eq > 0 else "not run"
        lines.append(f"| {mod} | {' '.join(tests[mod])} | {n} | {killed} | {c['timeout']} | {c['survived']} | "
                     f"{c['no tests']} | {other} | {score} | {score_eq} |")
    for mod in modules:
        if not survivors.get(mod):
            continue
        lines += ["", f"## Survivors of {mod}", ""]
        unchecked = [n for n in survivors[mod] if status[n] in ("not checked", "skipped")]
        if unchecked:  # the run stopped before them: no diff, just how many
            lines += [f"{len(unchecked)} mutants not checked (the run was stopped or skipped them).", ""]
        for name in survivors[mod]:
            if name in unchecked:
                continue
            tag = f" — **equivalent**: {equiv[name]}" if name in equiv else ""
            lines.append(f"### `{name}` ({status[name]}){tag}")
            diff = subprocess.run(["mutmut", "show", name], cwd=work, capture_output=True, text=True).stdout
            body = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
            lines += ["```diff", *body[:12], "```"]
    stale = stale_equivalents(status, selected(equiv, only), [m for m in modules if per.get(m)])
    for mod in modules:
        if stale.get(mod):
            lines += ["", f"## Stale entries of {mod} in equivalent.txt (re-judge or remove)", "",
                      *[f"* {entry}" for entry in stale[mod]]]
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="+", help="source files to mutate (paths from the repository root)")
    ap.add_argument("--tests", nargs="*", help="test files or folders (default: each module's mirrored folders)")
    ap.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1: it is CPU heavy)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ebpo-mutation"), help="where the copy is made")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "mutation" / "REPORT.md")
    ap.add_argument("--equivalent", type=Path, default=ROOT / "docs" / "mutation" / "equivalent.txt")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. \"-k 'not ray'\"")
    ap.add_argument("--report-only", action="store_true", help="write the report of the run in --workdir")
    ap.add_argument("--keep", action="store_true", help="reuse an existing --workdir (resume a run)")
    ap.add_argument("--only", nargs="+", metavar="PATTERN",
                    help="run (and report) only the mutants whose names match these fnmatch patterns, e.g. "
                         "'ebpo.core.likelihood.x_composite_logprobs_blockwise__mutmut_*' after that function changed")
    ap.add_argument("--timeout-multiplier", type=float, default=None,
                    help="a mutant times out (and counts as killed) after (its tests' clean duration + 1 s) "
                         "times this (mutmut's default: 15); a smaller one ends hanging mutants sooner")
    a = ap.parse_args()
    modules = [m.removeprefix("./") for m in a.modules]
    for m in modules:
        if not (ROOT / m).is_file():
            raise SystemExit(f"mutation.py: no such module {m}")
    tests = {m: a.tests or mirrored_tests(m) for m in modules}
    all_tests = sorted({t for ts in tests.values() for t in ts})
    command = "python scripts/mutation.py " + " ".join(sys.argv[1:])
    work = a.workdir.resolve()
    minutes = None
    if not a.report_only:
        if shutil.which("mutmut") is None:
            raise SystemExit("mutation.py: mutmut is not installed (pip install -e '.[dev]')")
        if work.exists() and not a.keep:
            shutil.rmtree(work)
        if not work.exists():
            work.mkdir(parents=True)
            copy_tree(work)
        configure(work, modules, all_tests, shlex.split(a.pytest_args), a.timeout_multiplier)
        t0 = time.monotonic()
        env = dict(os.environ, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        # scripts/mutmut_run.py: mutmut run, robust to the code reward sandbox's reaped orphans
        rc = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutmut_run.py"), "run", "--max-children",
                             str(a.jobs), *(a.only or [])], cwd=work,
                            env=env).returncode
        minutes = (time.monotonic() - t0) / 60
        if rc not in (0, 1):
            print(f"mutation.py: mutmut exited with {rc}", file=sys.stderr)
    print(report(work, modules, tests, a.out, a.equivalent, minutes, command, a.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
