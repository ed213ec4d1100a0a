"""Rewards of the fair Levenshtein test (issue 36; docs/levenshtein_fair_test.md): copy / reverse a string.

    reward:
      fns:
        - {fn: examples/rewards/lev_fair.py:exact_answer, weight: 1.0}
        - {fn: examples/rewards/lev_fair.py:similarity, weight: 0.5, judge: false}

`exact_answer` is the task's verdict. `similarity` is shaping only: a tiny model's groups of 8 samples are often
all wrong on long strings, and a graded score keeps their advantages non-zero. It is difflib's ratio
2 * matches / (len a + len b) over matching blocks, so a dropped or repeated letter costs one letter's share,
not every letter after it: the shaping does not favour substitution-only answers over length edits.
Standard library only (a reward file may import only `rewards` of ours).
"""
from __future__ import annotations

import difflib


def exact_answer(*, completion: str, answer: str, **_) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer, else 0.0."""
    return float((completion or "").strip() == (answer or ""))


def similarity(*, completion: str, answer: str, **_) -> float:
    """difflib.SequenceMatcher ratio in [0, 1] of the stripped completion against the answer."""
    return difflib.SequenceMatcher(None, (completion or "").strip(), answer or "", autojunk=False).ratio()
