"""reasoning-gym's own verifier as a reward: `score_answer` of the task a row came from.

A row built from a reasoning-gym dataset (`data.train: rg:NAME?size=...&seed=...`, `ebpo.infra.task_libraries`)
carries the entry's `answer` and `metadata`; `metadata["source_dataset"]` names the task, whose registered
`score_answer(answer, entry)` scores the model's answer (reasoning-gym's verifier, not ours: partial credit
where the task gives it, e.g. 0.4 for a right number with extra whitespace in some tasks).

The model's answer is taken from the completion the way reasoning-gym's prompts ask for it, else the way
our models write it: the last `<answer>...</answer>`, else the last `\\boxed{...}`, else the whole completion,
stripped. Needs the `envs` extra (`pip install -e '.[envs]'`).
"""
from __future__ import annotations

import re

from rewards.api import RewardResult, skip

_OPEN, _CLOSE = "<answer>", "</answer>"
BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")  # linear: `[^{}]*` stops at the next brace, which every opener holds


def last_answer_tag(text: str) -> str | None:
    """The text of the last `<answer>...</answer>` pair, pairs taken left to right, each opener with the first
    closer after it (what `re.findall(r"<answer>(.*?)</answer>", text, re.S)[-1]` gives), or None. One pass
    of `str.find`: linear in the length of the text. (The lazy regular expression is quadratic on openers
    without a closer, each scanning to the end: 74-91 s for 64k characters of unclosed `<answer>`.)"""
    last, pos = None, 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            return last
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:  # no closer after this opener: none after any later one either
            return last
        last, pos = text[start + len(_OPEN):end], end + len(_CLOSE)


def extract_answer(completion: str) -> str:
    """The model's final answer in `completion` (module docstring): `<answer>` tag, `\\boxed{}`, else all of it.
    Linear in the length of the completion."""
    text = completion or ""
    tag = last_answer_tag(text)
    if tag is not None:
        return tag.strip()
    boxed = BOXED_RE.findall(text)
    if boxed:
        return boxed[-1].strip()
    return text.strip()


def row_metadata(metadata, key: str) -> dict | None:
    """The task library's metadata dict holding `key`: `metadata` itself (`ebpo eval` passes the row's
    `metadata`), or `metadata["metadata"]` (the RL loop passes the row's other fields as `metadata`, so the
    row's own `metadata` field sits one level down); None when neither holds it."""
    for meta in (metadata, metadata.get("metadata") if isinstance(metadata, dict) else None):
        if isinstance(meta, dict) and meta.get(key):
            return meta
    return None


def reasoning_gym_score(*, completion: str, answer, metadata, prompt: str | None = None, **_) -> RewardResult:
    """reasoning-gym's `score_answer` for the row's task, on the answer extracted from `completion`.

    answer, metadata: the reasoning-gym entry's fields (the row's, or the RL loop's metadata holding them,
    `row_metadata`); prompt: its question. Returns the task's
    score in [0, 1]; skips (score None) when the row is not a reasoning-gym entry or reasoning-gym is not
    installed; a verifier that raises scores 0.0 (extras["error"] names the exception). extras: `pred`."""
    metadata = row_metadata(metadata, "source_dataset")
    if metadata is None:
        return skip("not a reasoning-gym row: metadata has no source_dataset")
    try:
        import reasoning_gym
    except ImportError:
        return skip("reasoning-gym is not installed (pip install -e '.[envs]')")
    name = str(metadata["source_dataset"])
    try:
        score_fn = reasoning_gym.get_score_answer_fn(name)
    except Exception as e:  # noqa: BLE001 - an unknown task is the row's problem, not the run's
        return skip(f"reasoning-gym has no task {name!r}: {type(e).__name__}")
    pred = extract_answer(completion)
    entry = {"question": prompt, "answer": answer, "metadata": metadata}
    extras = {"pred": pred[:200], "task": name}
    try:
        score = float(score_fn(pred, entry))
    except Exception as e:  # noqa: BLE001 - a verifier that raises on this answer gives it no credit
        return RewardResult(0.0, {**extras, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    if not 0.0 <= score <= 1.0:  # NaN included
        return RewardResult(0.0, {**extras, "error": f"score_answer returned {score!r}"})
    return RewardResult(score, extras)
