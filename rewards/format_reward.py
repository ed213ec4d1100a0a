"""Built-in format rewards: checks of the answer's form, not its content (1.0 pass / 0.0 fail)."""
from __future__ import annotations

import re

from rewards.api import RewardResult

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def code_blocks(text: str) -> list[tuple[str, str]]:
    """All fenced blocks as ``(language, body)`` in order of appearance."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]


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
