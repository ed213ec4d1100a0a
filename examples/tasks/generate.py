"""Deterministic generator of the two synthetic tasks the shipped tiny model is trained and evaluated on.

    python examples/tasks/generate.py --out examples/data            # the shipped files (seed 0)

Writes `{math,code}_{train,eval}.jsonl` and `cpt_corpus.jsonl`. The same seed always gives byte-identical
files; held-out prompts never occur in the training split.

* math: short arithmetic (two or three two-digit operands, a product by one digit) and tiny word problems.
  Row: `{"prompt", "answer", "response", "task": "math"}`; the response is `\\boxed{ANSWER}` so that
  math-verify (the `math` reward) extracts it.
* code: a function described in words, e.g. "Write f(x): multiply x by 3, then add 1." whose reference
  response is `def f(x):\\n    return x*3+1`. Row: `{"prompt", "tests", "response", "task": "code"}` with
  three `assert f(v)==...` tests checked by the sandboxed `code` reward. One to three composed operations.

Difficulty is set so that a ~1.4M-parameter model trained for minutes on 2 CPU cores learns part of it
(REFERENCE.md section 8: two-digit addition alone is learnt almost perfectly, leaving RL nothing to do).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Bob", "Eve", "Tom", "Mia", "Sam", "Zoe", "Max"]
THINGS = ["pens", "cards", "apples", "coins", "books", "shells"]


MATH_KINDS = {
    # easy: one operation on two numbers, or a one-step word problem; what a tiny model learns in minutes
    "easy": ["add2", "add2", "add2", "sub2", "sub2", "mul2", "word_give"],
    # hard: adds three-operand mixes and two-step word problems (too hard for the CPU tiny budget)
    "hard": ["add2", "sub2", "mul2", "add3", "addsub", "subadd", "mul_add", "mul_sub", "word_buy", "word_give"],
}
# per level: choices of the number of composed operations, largest constant, function names
CODE_LEVELS = {"easy": ([1, 2, 2], 19, "fghpq"), "hard": ([1, 2, 2, 3], 9, "f")}


def math_row(rng: random.Random, level: str = "easy") -> dict:
    """One arithmetic question of the `level` mix; every integer answer is in [-99, 999]."""
    kind = rng.choice(MATH_KINDS[level])
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
    d = rng.randint(2, 9)
    if kind == "add2":
        q, ans = f"{a}+{b}", a + b
    elif kind == "sub2":
        q, ans = f"{a}-{b}", a - b
    elif kind == "mul2":
        q, ans = f"{a}*{d}", a * d
    elif kind == "add3":
        q, ans = f"{a}+{b}+{c}", a + b + c
    elif kind == "addsub":
        q, ans = f"{a}+{b}-{c}", a + b - c
    elif kind == "subadd":
        q, ans = f"{a}-{b}+{c}", a - b + c
    elif kind == "mul_add":
        q, ans = f"{a}*{d}+{c}", a * d + c
    elif kind == "mul_sub":
        q, ans = f"{a}*{d}-{c}", a * d - c
    elif kind == "word_buy":
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        prompt = f"{who} has {a} {what} and buys {d} packs of {b % 10 + 2}. How many {what}?"
        ans = a + d * (b % 10 + 2)
        return {"prompt": prompt, "answer": str(ans), "response": f"\\boxed{{{ans}}}", "task": "math"}
    else:
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        prompt = f"{who} has {a + b} {what} and gives away {b}, then finds {d}. How many {what}?"
        ans = a + d
        return {"prompt": prompt, "answer": str(ans), "response": f"\\boxed{{{ans}}}", "task": "math"}
    return {"prompt": f"Compute {q}.", "answer": str(ans), "response": f"\\boxed{{{ans}}}", "task": "math"}


# (words, python template applied to the current expression, precedence of the result: 0 sum, 1 product, 2 atom)
def _op(rng: random.Random, n_max: int = 9):
    n = rng.randint(2, n_max)
    return rng.choice([
        (f"add {n}", lambda e, p: (f"{e}+{n}", 0)),
        (f"subtract {n}", lambda e, p: (f"{e}-{n}", 0)),
        (f"multiply by {n}", lambda e, p: (f"{e if p >= 1 else '(' + e + ')'}*{n}", 1)),
        ("square it", lambda e, p: (f"{e if p >= 2 else '(' + e + ')'}**2", 1)),
        ("negate it", lambda e, p: (f"-{e if p >= 1 else '(' + e + ')'}", 1)),
    ])


def code_row(rng: random.Random, level: str = "easy") -> dict:
    """One 'write f(x)' task of composed operations (easy: 1-2, hard: 1-3) and three assert tests."""
    n_choices, n_max, names = CODE_LEVELS[level]
    n_ops = rng.choice(n_choices)
    name = rng.choice(names) if len(names) > 1 else names
    expr, prec, words = "x", 2, []
    for _ in range(n_ops):
        w, apply = _op(rng, n_max)
        words.append(w)
        expr, prec = apply(expr, prec)
    desc = ", then ".join(words)
    prompt = f"Write {name}(x): take x, {desc}."
    f = eval(f"lambda x: {expr}")  # our own generated expression, not model output
    xs = rng.sample(range(-5, 11), 3)
    tests = [f"assert {name}({x})=={f(x)}" for x in xs]
    return {"prompt": prompt, "tests": tests, "response": f"def {name}(x):\n    return {expr}", "task": "code"}


def split_rows(make, rng: random.Random, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """Draw unique prompts; the first n_eval form the held-out split, the rest the training split."""
    seen, rows = set(), []
    while len(rows) < n_train + n_eval:
        row = make(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows[n_eval:], rows[:n_eval]


def cpt_documents(rows: list[dict]) -> list[dict]:
    """Plain-text documents (question then answer) for the CPT recipe: `{"text": ...}` rows."""
    return [{"text": f"{r['prompt']}\n{r['response']}"} for r in rows]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def generate(out: str | Path, seed: int = 0, n_train: int = 10000, n_eval: int = 200, n_cpt: int = 2000,
             level: str = "easy") -> list[Path]:
    """Write every split of the `level` mix ("easy" | "hard") under `out`; returns the paths written."""
    if level not in MATH_KINDS:
        raise ValueError(f"level must be one of {sorted(MATH_KINDS)}, got {level!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make, offset in (("math", math_row, 0), ("code", code_row, 1)):
        train, held = split_rows(lambda r, make=make: make(r, level), random.Random(seed * 1000 + offset),
                                 n_train, n_eval)
        for split, rows in (("train", train), ("eval", held)):
            write_jsonl(out / f"{name}_{split}.jsonl", rows)
            written.append(out / f"{name}_{split}.jsonl")
        if name == "math":
            math_train = train
        else:
            code_train = train
    docs = cpt_documents(math_train[: n_cpt // 2] + code_train[: n_cpt // 2])
    write_jsonl(out / "cpt_corpus.jsonl", docs)
    written.append(out / "cpt_corpus.jsonl")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=10000, help="training rows per task")
    ap.add_argument("--n-eval", type=int, default=200, help="held-out rows per task")
    ap.add_argument("--n-cpt", type=int, default=2000, help="CPT documents")
    ap.add_argument("--level", default="easy", choices=sorted(MATH_KINDS),
                    help="task mix: easy (the shipped data) or hard (multi-step; for larger budgets)")
    args = ap.parse_args(argv)
    for p in generate(args.out, args.seed, args.n_train, args.n_eval, args.n_cpt, args.level):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
