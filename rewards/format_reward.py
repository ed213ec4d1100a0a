"""Built-in format rewards: checks of the answer's form, not its content (1.0 pass / 0.0 fail).

Every parse of policy text here is linear in its length (``str.find`` scans and regular expressions
that cannot backtrack): a completion is attacker-chosen text, and a parse that backtracks turns a
megabyte of it into minutes of the reward process's time.
"""
from __future__ import annotations

import re

from rewards.api import RewardResult

_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")  # one greedy class after another: no backtracking


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = j = start + len("\\boxed{")
    depth = 1
    while True:  # depth only grows between two "}", so it can reach 0 only on one: jump from "}" to "}"
        k = text.find("}", j)
        if k < 0:
            return None
        depth += text.count("{", j, k) - 1
        if depth == 0:
            return text[i:k]
        j = k + 1


def code_blocks(text: str) -> list[tuple[str, str]]:
    """All fenced blocks as ``(language, body)`` in order of appearance: a fence, an optional language
    tag on the rest of its line, the body up to the next fence. One left-to-right pass of ``str.find``
    (linear; a regular expression for this backtracks quadratically on a fence followed by a long line)."""
    out, pos = [], 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return out
        newline = text.find("\n", start + 3)
        if newline < 0:  # no line break after this fence: no later fence can open a block either
            return out
        end = text.find("```", newline + 1)
        if end < 0:  # unclosed: every later fence would have closed it, so there is none
            return out
        lang = _LANG.match(text, start + 3, newline).group(1)
        out.append((lang.lower(), text[newline + 1:end]))
        pos = end + 3


def format_boxed(*, completion: str, **_) -> RewardResult:
    """1.0 if the completion has a non-empty, balanced ``\\boxed{...}``."""
    box = last_boxed(completion or "")
    return RewardResult(1.0 if box is not None and box.strip() else 0.0)


def format_code(*, completion: str, language: str = "python", **_) -> RewardResult:
    """1.0 if the completion has a fenced code block in ``language`` (or untagged) with a body."""
    accepted = ("", language.lower(), "py" if language == "python" else language)
    blocks = [b for lang, b in code_blocks(completion or "") if lang in accepted]
    return RewardResult(1.0 if any(b.strip() for b in blocks) else 0.0)


def format_reward(*, completion: str, kind: str = "boxed", language: str = "python", **_) -> RewardResult:
    """``kind="boxed"`` -> :func:`format_boxed`; ``kind="code"`` -> :func:`format_code`."""
    if kind == "boxed":
        return format_boxed(completion=completion)
    if kind == "code":
        return format_code(completion=completion, language=language)
    raise ValueError(f"format reward: kind must be 'boxed' or 'code', got {kind!r}")
