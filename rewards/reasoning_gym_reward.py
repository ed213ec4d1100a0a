"""reasoning-gym's own verifier as a reward: `score_answer` of the task a row came from.

A row built from a reasoning-gym dataset (`data.train: rg:NAME?size=...&seed=...`, `ebpo.infra.task_libraries`)
carries the entry's `answer` and `metadata`; `metadata["source_dataset"]` names the task, whose registered
`score_answer(answer, entry)` scores the model's answer (reasoning-gym's verifier, not ours: partial credit
where the task gives it, e.g. 0.4 for a right number with extra whitespace in some tasks).

The model's answer is taken from the completion the way reasoning-gym's prompts ask for it, else the way
our models write it: the last `<answer>...</answer>`, else the last `\\boxed{...}`, else the whole completion,
stripped. Needs the `envs` extra (`pip install -e '.[envs]'`).

The verifier is third-party code fed policy text (several tasks `eval` the answer or give it to sympy's
`parse_expr`): it runs in the verifier sandbox, never in this process, and only a float comes back. Tasks
whose verifier has a known loophole are wrapped with the check it lacks (`LOOPHOLES`).
"""
from __future__ import annotations

import importlib.util
import re

from rewards import verifier_sandbox
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


def _puzzle24_numbers(pred: str, metadata: dict) -> str | None:
    """puzzle24's verifier accepts any four in-range numbers that make 24 (`6*4*1*1` for the puzzle 8, 5, 10,
    6): the answer's integers (found as the task finds them) must be the puzzle's numbers, each once."""
    used = sorted(int(n) for n in re.findall(r"\b\d+\b", pred))
    want = metadata.get("numbers")
    if not isinstance(want, (list, tuple)):
        return "the row's metadata has no puzzle numbers to check against"
    return None if used == sorted(int(n) for n in want) else "the answer does not use the puzzle's numbers"


# Task verifiers with a known loophole: task -> (the check it lacks, run here on the answer text before the
# verifier, and the score the task gives a wrong answer). docs/rewards.md lists them.
LOOPHOLES = {"puzzle24": (_puzzle24_numbers, 0.01)}


def reasoning_gym_score(*, completion: str, answer, metadata, prompt: str | None = None, sandbox: str = "auto",
                        timeout_s: float = 5.0, memory_mb: int = 1024, **_) -> RewardResult:
    """reasoning-gym's `score_answer` for the row's task, on the answer extracted from `completion`, run in the
    verifier sandbox (`rewards.verifier_sandbox`): the verifier is third-party code fed policy text.

    answer, metadata: the reasoning-gym entry's fields (the row's, or the RL loop's metadata holding them,
    `row_metadata`); prompt: its question. sandbox: the verifier sandbox's mode (auto, namespaces, chroot,
    none); timeout_s, memory_mb: the verifier's deadline and memory above the server's own. Returns the task's
    score in [0, 1]; skips (score None) when the row is not a reasoning-gym entry, names no task reasoning-gym
    has, or reasoning-gym is not installed; a verifier that raises, runs past its deadline or returns
    something else scores 0.0 (extras["error"] says which). An answer a task with a known loophole would
    wrongly accept (`LOOPHOLES`) scores that task's wrong-answer score, extras["loophole"] saying why.
    extras: `pred`, `task`."""
    metadata = row_metadata(metadata, "source_dataset")
    if metadata is None:
        return skip("not a reasoning-gym row: metadata has no source_dataset")
    if importlib.util.find_spec("reasoning_gym") is None:
        return skip("reasoning-gym is not installed (pip install -e '.[envs]')")
    name = str(metadata["source_dataset"])
    pred = extract_answer(completion)
    extras = {"pred": pred[:200], "task": name}
    if name in LOOPHOLES:
        check, wrong = LOOPHOLES[name]
        why = check(pred, metadata)
        if why is not None:
            return RewardResult(wrong, {**extras, "loophole": why})
    entry = {"question": prompt, "answer": answer, "metadata": metadata}
    out = verifier_sandbox.score("rg", {"task": name, "answer": pred, "entry": entry}, gold=answer,
                                 timeout_s=timeout_s, memory_mb=memory_mb, mode=sandbox)
    if "skip" in out:
        return skip(out["skip"])
    if "error" in out:
        return RewardResult(0.0, {**extras, "error": out["error"]})
    return RewardResult(out["score"], extras)
