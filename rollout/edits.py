"""Edit precision: did the decoder's T2T (and MBE) rewrites fix tokens or break them?

Each rewrite of a visible token is `(offset, old, new)` (offset counted from the end of the prompt, as in
`GenerationOutput.edit_log`). Against a reference completion (the known correct response of an arithmetic
row, EOS included) an edit is

* a **fix** when it writes the reference token over a different one (`old != ref`, `new == ref`);
* a **break** when it overwrites the reference token with another (`old == ref`, `new != ref`);
* neutral otherwise (a wrong token replaced by another wrong one, or a position past the reference).

edit precision = fixes / (fixes + breaks), summed over sequences (undefined, reported as NaN, when no edit
fixed or broke anything). The counts are per position of the canvas, so a model that answers in another
layout than the reference (a bare answer where the reference shows its working) has its edits compared
with unrelated tokens: the metric is meant for a task, like the arithmetic one, whose answers follow one
layout.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EditCounts:
    """Edits of one or more sequences: all rewrites, fixes and breaks (see module docstring)."""

    edits: int = 0
    fixes: int = 0
    breaks: int = 0

    def __add__(self, other: "EditCounts") -> "EditCounts":
        return EditCounts(self.edits + other.edits, self.fixes + other.fixes, self.breaks + other.breaks)

    @property
    def precision(self) -> float:
        """fixes / (fixes + breaks); NaN when neither happened."""
        n = self.fixes + self.breaks
        return self.fixes / n if n else float("nan")


def edit_counts(edit_log, reference: list[int]) -> EditCounts:
    """Score one sequence's rewrites `edit_log` [(offset, old, new), ...] against `reference` token ids."""
    out = EditCounts()
    for offset, old, new in edit_log:
        out.edits += 1
        if 0 <= offset < len(reference):
            ref = reference[offset]
            out.fixes += int(old != ref and new == ref)
            out.breaks += int(old == ref and new != ref)
    return out


def edit_metrics(tasks: list[str], counts: list, prefix: str = "eval/") -> dict[str, float]:
    """`<prefix><task>/{edit_precision,edits_per_seq,fixes_per_seq,breaks_per_seq}` over the rows of each task
    whose `counts` entry (a `rollout.edits.EditCounts`) is not None (rows with a reference response)."""
    by_task: dict[str, list] = {}
    for t, c in zip(tasks, counts):
        if c is not None:
            by_task.setdefault(t, []).append(c)
    m = {}
    for t, cs in sorted(by_task.items()):
        total = sum(cs, EditCounts())
        n = len(cs)
        m.update({f"{prefix}{t}/edit_precision": total.precision, f"{prefix}{t}/edits_per_seq": total.edits / n,
                  f"{prefix}{t}/fixes_per_seq": total.fixes / n, f"{prefix}{t}/breaks_per_seq": total.breaks / n})
    return m
