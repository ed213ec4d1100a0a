"""Held-out accuracy of a model with the project's own decoder (`rollout.generate`) and rewards.

    res = evaluate_rows(model, tokenizer, rows, preset="quality", decode={"max_new_tokens": 40})
    res.metrics(prefix="eval/quality/")  # {"eval/quality/math/accuracy": ..., "eval/quality/tpf": ...}

Rows are dataset rows: math rows carry `answer`, code rows `tests`; `task` (else inferred from those
fields) groups the accuracy. A row counts as solved when its task's reward gives full marks: `math`
(math-verify equivalence of the completion's final answer) or `code` (every test passes in the sandbox).
Decoding is greedy (the presets' temperature 0) and one seed per row, so results are reproducible.

Edit precision (`rollout.edits`): rows that carry their correct `response` (the arithmetic task does)
get each decoder rewrite scored as a fix (it writes the reference token) or a break (it overwrites the
reference token); `metrics()` reports `<task>/edit_precision` = fixes / (fixes + breaks) over the set and
`<task>/{edits,fixes,breaks}_per_seq`.

Preset names: the decoder's presets (`quality`, `speed`, `m2t`) plus `speed_noedit`, Speedy Mode with
the T2T editing step switched off (see `PRESETS`).
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rewards.format_reward import last_boxed as boxed_answer  # noqa: F401 (re-exported)

from ebpo.infra.data import encode_prompt, reference_ids  # noqa: F401 (reference_ids re-exported)
from rollout.edits import edit_metrics  # noqa: F401 (re-exported: RL evaluation uses it too)

# name -> (decoder preset, overrides). `speed_noedit` keeps Speedy Mode's unmasking threshold and
# post-step budget but never edits a committed token.
PRESETS: dict[str, tuple[str, dict]] = {
    "quality": ("quality", {}),
    "speed": ("speed", {}),
    "m2t": ("m2t", {}),
    "speed_noedit": ("speed", {"tau_edit": None}),
}


def task_of(row: dict) -> str:
    """The row's task name: its `task` field, else "math" when it has an answer, "code" when it has tests."""
    if row.get("task"):
        return str(row["task"])
    if rg_task(row):
        return rg_task(row)
    if row.get("tests") is not None:
        return "code"
    if row.get("answer") is not None:
        return "math"
    raise ValueError(f"evaluation row has neither 'task', 'answer' nor 'tests': fields {sorted(row)}")


def rg_task(row: dict) -> str | None:
    """The reasoning-gym task of a row built from one (`rg:` sources: `metadata.source_dataset`), else None."""
    meta = row.get("metadata")
    return str(meta["source_dataset"]) if isinstance(meta, dict) and meta.get("source_dataset") else None


def balanced_subset(rows: list[dict], size: int) -> list[dict]:
    """The first rows of each task in turn (round robin) up to `size` rows in all (0 = all rows)."""
    if not size or size >= len(rows):
        return list(rows)
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(task_of(r), []).append(r)
    out, i = [], 0
    while len(out) < size:
        for group in by_task.values():
            if i < len(group) and len(out) < size:
                out.append(group[i])
        i += 1
    return out


def _exact_math(completion: str, answer) -> float:
    """Fallback when the `rewards` package is unavailable: exact match of the boxed answer."""
    got = boxed_answer(completion)
    return float(got is not None and re.sub(r"\s+", "", got) == re.sub(r"\s+", "", str(answer)))


def score_rows(rows: list[dict], completions: list[str], num_threads: int = 4) -> list[float]:
    """1.0 / 0.0 per row: full marks from the row's task reward (math: math-verify, code: sandboxed tests,
    a reasoning-gym row: its task's own `score_answer`)."""
    try:
        from rewards import load_reward

        math_fn, code_fn, rg_fn = load_reward("math"), load_reward("code"), load_reward("reasoning_gym")
    except ImportError:
        math_fn = code_fn = rg_fn = None
    scores = [0.0] * len(rows)

    def code_one(i: int) -> float:
        if code_fn is None:
            raise RuntimeError("code evaluation needs the rewards package (sandboxed tests)")
        # the prompt: helpers it defines are bound from it in the judge, never from the candidate
        res = code_fn(completion=completions[i], tests=rows[i]["tests"], prompt=rows[i].get("prompt"))
        return float(res.score is not None and res.score >= 1 - 1e-6)

    code_idx = [i for i, r in enumerate(rows) if task_of(r) != "math" and r.get("tests") is not None]
    with ThreadPoolExecutor(num_threads) as pool:  # each code check is its own sandboxed process
        futures = {i: pool.submit(code_one, i) for i in code_idx}
        for i, r in enumerate(rows):  # math on this thread: math-verify's alarm timeouts need the main thread
            if i in futures:
                continue
            if rg_task(r):
                if rg_fn is None:
                    raise RuntimeError("reasoning-gym rows need the rewards package (their task's score_answer)")
                res = rg_fn(completion=completions[i], answer=r.get("answer"), metadata=r["metadata"],
                            prompt=r.get("prompt"))
                scores[i] = float(res.score is not None and res.score >= 1 - 1e-6)
            elif math_fn is None:
                scores[i] = _exact_math(completions[i], r.get("answer"))
            else:
                res = math_fn(completion=completions[i], answer=r.get("answer"))
                scores[i] = float(res.score is not None and res.score >= 1 - 1e-6)
        for i, f in futures.items():
            scores[i] = f.result()
    return scores


@dataclass
class EvalResult:
    """Per-row correctness and decode statistics of one preset."""

    preset: str
    tasks: list[str]
    correct: list[float]
    tokens: int
    forwards: int
    edits: int
    wall_s: float
    samples: list[dict] = field(default_factory=list)
    edit_counts: list = field(default_factory=list)  # per row: rollout.edits.EditCounts, None without a reference

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / max(len(self.correct), 1)

    def task_accuracy(self) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for t, c in zip(self.tasks, self.correct):
            out.setdefault(t, []).append(c)
        return {t: sum(v) / len(v) for t, v in sorted(out.items())}

    @property
    def tpf(self) -> float:
        """Generated tokens (up to and including EOS) per model forward, over the whole set."""
        return self.tokens / max(self.forwards, 1)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        m = {f"{prefix}{t}/accuracy": a for t, a in self.task_accuracy().items()}
        n = max(len(self.correct), 1)
        m.update({f"{prefix}accuracy": self.accuracy, f"{prefix}tpf": self.tpf,
                  f"{prefix}forwards_per_seq": self.forwards / n, f"{prefix}edits_per_seq": self.edits / n,
                  f"{prefix}wall_s": self.wall_s})
        m.update(edit_metrics(self.tasks, self.edit_counts, prefix))
        return m


def decode_config(preset: str, decode: dict | None = None):
    """The `rollout.DecodeConfig` of a preset name of `PRESETS` plus overrides."""
    from rollout import DecodeConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown evaluation preset {preset!r}; choose one of {sorted(PRESETS)}")
    base, extra = PRESETS[preset]
    return DecodeConfig.preset(base, **{**extra, **(decode or {})})


@torch.no_grad()
def evaluate_rows(model, tokenizer, rows: list[dict], preset: str = "quality", decode: dict | None = None,
                  batch_size: int = 64, chat_template: bool = True, prompt_field: str = "prompt",
                  seed: int = 0, max_prompt_tokens: int | None = None, keep_samples: int = 8) -> EvalResult:
    """Decode every row's prompt with `preset` and score it; returns an `EvalResult`."""
    from rollout import generate

    config = decode_config(preset, decode)
    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tokenizer, r[prompt_field], chat_template, max_prompt_tokens) for r in rows]
    outs = []
    t0 = time.perf_counter()
    try:
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s:s + batch_size]
            outs += generate(model, chunk, config, tokenizer=tokenizer, seeds=[seed + s + i for i in range(len(chunk))])
    finally:
        model.train(was_training)
    wall = time.perf_counter() - t0
    texts = [o.text for o in outs]
    correct = score_rows(rows, texts)
    samples = [{"prompt": r[prompt_field], "completion": t, "correct": c}
               for r, t, c in zip(rows[:keep_samples], texts, correct)]
    from rollout.edits import edit_counts

    refs = [reference_ids(tokenizer, r) for r in rows]
    counts = [None if ref is None else edit_counts(o.edit_log, ref) for o, ref in zip(outs, refs)]
    return EvalResult(preset=preset, tasks=[task_of(r) for r in rows], correct=correct,
                      tokens=sum(len(o.token_ids) for o in outs), forwards=sum(o.num_forwards for o in outs),
                      edits=sum(o.num_edits for o in outs), wall_s=wall, samples=samples, edit_counts=counts)
