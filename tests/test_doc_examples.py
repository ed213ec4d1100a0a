"""The Python examples of README.md and the docs/ pages run, and print what they say they print.

Every fenced ```python block is an example. The blocks of one file run in order, in one fresh interpreter
(cwd = the repository root), as a script whose line numbers are the markdown file's: a traceback names
the doc line. Conventions a doc writer uses:

* `# doc-test: skip (reason)` as the first line of a block: the block is not run (it is still compiled),
  and the reader sees why (a GPU, a cluster, a long training run).
* `# -> TEXT` anywhere in a block: running the block writes TEXT to stdout (checked as a substring of
  what that block printed).

Spawned worker processes re-import the script (as `__mp_main__`), so examples that start them keep their
work under `if __name__ == "__main__":`, as a user's script must.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every page of the site, in sub-folders too; docs/mutation/ holds mutation-testing records, not examples
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                    if "mutation" not in p.relative_to(ROOT / "docs").parts)]
MIN_BLOCKS_RUN = 4  # raise it when examples are added; a drop means blocks were skipped or not found
TIMEOUT_S = 300

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
SKIP = re.compile(r"^#\s*doc-test:\s*skip\b\s*(?P<reason>.*)$")
EXPECT = re.compile(r"#\s*->\s*(?P<text>.+?)\s*$")
MARK = "@@doc-block {}@@"
# Line 1 of the generated script (line 1 of a markdown file is never code: a fence comes first).
PREAMBLE = f"__doc_block__ = lambda n: __name__ == '__main__' and print({MARK!r}.format(n), flush=True)"


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    code: list[str]
    skip: str | None = None
    expected: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def python_blocks(path: Path) -> list[Block]:
    """The fenced python blocks of a markdown file, dedented by their fence's indent."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["lang"].lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in ("python", "py"):
            code = [ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in lines[i + 1: j]]
            first = next((ln.strip() for ln in code if ln.strip()), "")
            skip = SKIP.match(first)
            blocks.append(Block(path, i + 2, code, skip=skip["reason"].strip() if skip else None,
                                expected=[e["text"] for ln in code if (e := EXPECT.search(ln))]))
        i = j + 1
    return blocks


def script_for(blocks: list[Block], n_lines: int) -> str:
    """One script running the blocks that are not skipped, each line at its markdown line number."""
    out = [""] * (n_lines + 1)
    out[0] = PREAMBLE
    for b in blocks:
        if b.skip is not None:
            continue
        fence = b.line - 2  # 0-based index of the opening fence line
        out[fence] = f"{out[fence]}; __doc_block__({b.line})" if fence == 0 else f"__doc_block__({b.line})"
        for k, code in enumerate(b.code):
            out[b.line - 1 + k] = code
    return "\n".join(out) + "\n"


ALL_BLOCKS = {p: python_blocks(p) for p in DOCS}


def test_doc_blocks_are_found_and_compile():
    blocks = [b for bs in ALL_BLOCKS.values() for b in bs]
    for b in blocks:
        compile("\n".join(b.code) + "\n", b.where, "exec")  # skipped blocks too: they must stay valid Python
        if b.skip is not None:
            assert b.skip.startswith("(") and len(b.skip) > 2, f"{b.where}: a skipped block says why: (reason)"
    runnable = [b for b in blocks if b.skip is None]
    assert len(runnable) >= MIN_BLOCKS_RUN, f"only {len(runnable)} runnable doc examples: {[b.where for b in runnable]}"


def run_file(path: Path, blocks: list[Block], tmp: Path) -> tuple[list[int], list[str]]:
    """Run one file's blocks; returns (lines of the blocks that ran to completion, failure messages)."""
    script = tmp / (rel(path).replace("/", "__").lstrip("_") + ".py")
    script.write_text(script_for(blocks, len(path.read_text().splitlines())))
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    runnable = [b for b in blocks if b.skip is None]
    # stdout split by the markers: segment k is what block k printed
    parts = re.split(r"@@doc-block (\d+)@@\n", proc.stdout)
    printed = {int(parts[k]): parts[k + 1] for k in range(1, len(parts) - 1, 2)}
    started = list(printed)
    failures = []
    if proc.returncode != 0:
        line = started[-1] if started else runnable[0].line
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        failures.append(f"{rel(path)}: the block at line {line} failed (exit {proc.returncode}); "
                        f"traceback line numbers are lines of the markdown file:\n{tail}")
        done = started[:-1]
    else:
        done = started
        if started != [b.line for b in runnable]:
            failures.append(f"{rel(path)}: blocks at lines {[b.line for b in runnable]} should "
                            f"have run, these did: {started}")
    for b in runnable:
        if b.line in done:
            for text in b.expected:
                if text not in printed[b.line]:
                    failures.append(f"{b.where}: the block says it prints {text!r}; it printed:\n"
                                    f"{printed[b.line].rstrip() or '(nothing)'}")
    return done, failures


def test_doc_examples_run(tmp_path):
    ran, failures = [], []
    for path, blocks in ALL_BLOCKS.items():
        if any(b.skip is None for b in blocks):
            done, errs = run_file(path, blocks, tmp_path)
            ran += [f"{rel(path)}:{line}" for line in done]
            failures += errs
    assert not failures, "\n\n".join(failures)
    assert len(ran) >= MIN_BLOCKS_RUN, f"only {len(ran)} doc examples ran: {ran}"


def test_the_runner_skips_marked_blocks_and_checks_outputs(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# A doc\n\n```python\nx = 40\n```\n\n```python\n# doc-test: skip (needs a GPU)\n"
                   "raise SystemExit(3)\n```\n\n- a list item:\n  ```python\n  print(x + 2)  # -> 42\n  ```\n"
                   "\n```python\nprint('no')  # -> yes\n```\n\n```python\nraise ValueError('boom')\n```\n")
    blocks = python_blocks(doc)
    assert [(b.line, b.skip, b.expected) for b in blocks] == [
        (4, None, []), (8, "(needs a GPU)", []), (14, None, ["42"]), (18, None, ["yes"]), (22, None, [])]
    done, failures = run_file(doc, blocks, tmp_path)
    assert done == [4, 14, 18]
    assert len(failures) == 2, failures
    assert "block at line 22 failed" in failures[0] and "line 22" in failures[0] and "ValueError: boom" in failures[0]
    assert failures[1].startswith(f"{doc}:18: the block says it prints 'yes'")
