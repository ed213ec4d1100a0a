"""Deterministic generator of the two synthetic tasks the shipped tiny model is trained and evaluated on.

    python examples/tasks/generate.py --out examples/data            # the shipped files (seed 0)

Writes `{math,code}_{train,eval}.jsonl`, `{math,code}_train_mixed.jsonl` (half the responses without
their working or function wrapper, for the RL quickstarts' starting model) and `cpt_corpus.jsonl`.
The same seed always gives byte-identical files; held-out prompts never occur in the training split.

* math (level `worked`, the default): `Compute 74+27.`, `Compute 25-80.`, `Compute 42*4.`, and word
  problems (`Mia has 63 books and gives away 59. How many books?`). Row: `{"prompt", "answer", "response",
  "task": "math"}`; the response is the column working then the answer, `4+7=11 7+2+1=10 \\boxed{101}`, so
  that math-verify (the `math` reward) extracts the boxed answer. Level `easy` has bare `\\boxed{ANSWER}`
  responses, `hard` adds three-operand and two-step questions.
* code: a function described in words, e.g. "Write f(x): multiply x by 3, then add 1." whose reference
  response is `def f(x):\\n    return x*3+1`. Row: `{"prompt", "tests", "response", "task": "code"}` with
  three `assert f(v)==...` tests checked by the sandboxed `code` reward. One to three composed operations.

Difficulty is set so that a ~1.4M-parameter model trained for minutes on 2 CPU cores learns part of it.
Measured (docs/training.md): with bare answers (`easy`) the tiny model stays at 2-4% on math after
2,500 steps, it has to add two-digit numbers in one step; with the working it learns the columns.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Bob", "Eve", "Tom", "Mia", "Sam", "Zoe", "Max"]
THINGS = ["pens", "cards", "apples", "coins", "books", "shells"]


MATH_KINDS = {
    # worked (the shipped data): one column operation on two numbers, or a one-step word problem, with the
    # digit-by-digit working before the boxed answer (see `worked_math_row`)
    "worked": ["add2", "add2", "sub2", "sub2", "mul2", "word_find", "word_give"],
    # easy: the same kinds of question with the bare boxed answer (a tiny model stays at ~2-4% on it)
    "easy": ["add2", "add2", "add2", "sub2", "sub2", "mul2", "word_give"],
    # hard: adds three-operand mixes and two-step word problems (too hard for the CPU tiny budget)
    "hard": ["add2", "sub2", "mul2", "add3", "addsub", "subadd", "mul_add", "mul_sub", "word_buy", "word_give"],
}
# per level: choices of the number of composed operations, largest constant, function names
CODE_LEVELS = {"worked": ([1, 2, 2], 19, "fghpq"), "easy": ([1, 2, 2], 19, "fghpq"), "hard": ([1, 2, 2, 3], 9, "f")}


def column_add(a: int, b: int) -> str:
    """Working of a + b (0 <= a, b <= 99), ones then tens: '5+8=13 6+2+1=9'."""
    s1 = a % 10 + b % 10
    carry = f"+{s1 // 10}" if s1 >= 10 else ""
    return f"{a % 10}+{b % 10}={s1} {a // 10}+{b // 10}{carry}={a // 10 + b // 10 + s1 // 10}"


def column_sub(a: int, b: int) -> str:
    """Working of a - b (0 <= b <= a <= 99), ones then tens, a borrow written as '13-8=5 7-2-1=4'."""
    borrow = a % 10 < b % 10
    ones = f"{a % 10 + 10 * borrow}-{b % 10}={a % 10 + 10 * borrow - b % 10}"
    return f"{ones} {a // 10}-{b // 10}{'-1' if borrow else ''}={a // 10 - b // 10 - borrow}"


def column_mul(a: int, d: int) -> str:
    """Working of a * d (10 <= a <= 99, 2 <= d <= 9), ones then tens: '8*5=40 1*5+4=9'."""
    p1 = a % 10 * d
    carry = f"+{p1 // 10}" if p1 >= 10 else ""
    return f"{a % 10}*{d}={p1} {a // 10}*{d}{carry}={a // 10 * d + p1 // 10}"


def worked_math_row(rng: random.Random) -> dict:
    """One question of the `worked` mix; the response shows the column working, then `\\boxed{ANSWER}`.

    A tiny model cannot add two-digit numbers in one step from characters, but each column of the
    working is a one-digit fact next to the digits it needs, so it learns the task in minutes."""
    kind = rng.choice(MATH_KINDS["worked"])
    a, b, d = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    if kind == "add2":
        prompt, work, ans = f"Compute {a}+{b}.", column_add(a, b), a + b
    elif kind == "sub2":
        prompt, ans = f"Compute {a}-{b}.", a - b
        work = column_sub(a, b) if a >= b else f"-({b}-{a}): {column_sub(b, a)}"
    elif kind == "mul2":
        prompt, work, ans = f"Compute {a}*{d}.", column_mul(a, d), a * d
    elif kind == "word_find":
        prompt, work, ans = f"{who} has {a} {what} and finds {b}. How many {what}?", column_add(a, b), a + b
    else:
        hi, lo = max(a, b), min(a, b)
        prompt, work, ans = f"{who} has {hi} {what} and gives away {lo}. How many {what}?", column_sub(hi, lo), hi - lo
    return {"prompt": prompt, "answer": str(ans), "response": f"{work} \\boxed{{{ans}}}", "task": "math"}


def fact_rows() -> list[dict]:
    """Every one-digit step that the `worked` working uses, as its own question: `Compute 4+7.` ->
    `4+7=11 \\boxed{11}` (ones columns), `Compute 7+2+1.` (tens with a carry), `Compute 13-8.` and
    `Compute 8-2-1.` (a borrow), `Compute 4*7.` and `Compute 4*7+2.` (tens of a product with a carry).

    Training only (`--fact-repeats`): their prompts have one-digit operands, so none is a held-out
    question. An experiment: the tiny model gets about half of the facts inside the working wrong, but
    drilling them separately did not change that (docs/training.md)."""
    exprs = [f"{a}+{b}" for a in range(10) for b in range(10)]
    exprs += [f"{a}+{b}+1" for a in range(1, 10) for b in range(1, 10)]
    exprs += [f"{top}-{b}" for top in range(19) for b in range(10) if 0 <= top - b <= 9]
    exprs += [f"{a}-{b}-1" for a in range(1, 10) for b in range(1, 10) if a - b - 1 >= 0]
    exprs += [f"{a}*{d}" for a in range(10) for d in range(2, 10)]
    exprs += [f"{a}*{d}+{c}" for a in range(1, 10) for d in range(2, 10) for c in range(1, 9 * d // 10 + 1)]
    rows = []
    for e in exprs:
        value = eval(e)  # noqa: S307 - built above from digits and operators
        rows.append({"prompt": f"Compute {e}.", "answer": str(value), "response": f"{e}={value} \\boxed{{{value}}}",
                     "task": "math"})
    return rows


def math_row(rng: random.Random, level: str = "worked") -> dict:
    """One arithmetic question of the `level` mix; every integer answer is in [-99, 999]."""
    if level == "worked":
        return worked_math_row(rng)
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


def code_row(rng: random.Random, level: str = "worked") -> dict:
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
    """Draw unique prompts, shuffle them, and cut the first n_eval off as the held-out split.

    The shuffle matters: prompts from a small pool (e.g. `take x, negate it`, a few dozen distinct
    strings) are all drawn early, so taking the first draws as held-out put every one of them there
    and none in training.
    """
    seen, rows = set(), []
    while len(rows) < n_train + n_eval:
        row = make(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    rng.shuffle(rows)
    return rows[n_eval:], rows[:n_eval]


def bare_response(row: dict) -> str:
    """The answer without its working: `\\boxed{ANSWER}` for math, the bare expression for code (no
    `def`, so the tests, which call the function, fail on it)."""
    if row["task"] == "math":
        return f"\\boxed{{{row['answer']}}}"
    return row["response"].split("return ", 1)[1]


def mixed_style_rows(rows: list[dict], bare_fraction: float, rng: random.Random) -> list[dict]:
    """Copies of the worked `rows` in which a `bare_fraction` of the responses (drawn per row with `rng`)
    are bare (`bare_response`); the rest are unchanged. Same order, same prompts.

    Real SFT data mixes answers that show their reasoning with answers that do not, and code answers
    that write the function asked for with ones that give only its body. A model trained on this mix
    picks either style for a question, and the bare style is almost always wrong (the tiny model cannot
    add two-digit numbers in one step; a bare expression defines no function): the RL quickstarts start
    from such a model (`recipes/sft_tiny_mixed.yaml`) and learn from the reward alone to answer in full."""
    if not 0.0 <= bare_fraction <= 1.0:
        raise ValueError(f"bare_fraction must be in [0, 1], got {bare_fraction}")
    return [dict(r, response=bare_response(r)) if rng.random() < bare_fraction else dict(r) for r in rows]


def cpt_documents(rows: list[dict]) -> list[dict]:
    """Plain-text documents (question then answer) for the CPT recipe: `{"text": ...}` rows."""
    return [{"text": f"{r['prompt']}\n{r['response']}"} for r in rows]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def generate(out: str | Path, seed: int = 0, n_train: int = 10000, n_eval: int = 200, n_cpt: int = 2000,
             level: str = "worked", fact_repeats: int = 0, bare_fraction: float = 0.5) -> list[Path]:
    """Write every split of the `level` mix ("worked" | "easy" | "hard") under `out`; returns the paths written.

    With the `worked` level it also writes `{math,code}_train_mixed.jsonl`: the training rows with a
    `bare_fraction` of bare responses (`mixed_style_rows`), the data of `recipes/sft_tiny_mixed.yaml`.

    `fact_repeats` copies of `fact_rows()` are shuffled into the math training split, on top of its
    `n_train` unique two-digit questions (default 0: five copies did not help the tiny model, see
    docs/training.md)."""
    if level not in MATH_KINDS:
        raise ValueError(f"level must be one of {sorted(MATH_KINDS)}, got {level!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make, offset in (("math", math_row, 0), ("code", code_row, 1)):
        train, held = split_rows(lambda r, make=make: make(r, level), random.Random(seed * 1000 + offset),
                                 n_train, n_eval)
        if name == "math" and fact_repeats:
            train = train + fact_rows() * fact_repeats
            random.Random(seed * 1000 + 7).shuffle(train)
        for split, rows in (("train", train), ("eval", held)):
            write_jsonl(out / f"{name}_{split}.jsonl", rows)
            written.append(out / f"{name}_{split}.jsonl")
        if name == "math":
            math_train = train
        else:
            code_train = train
    if level == "worked":
        for name, rows, offset in (("math", math_train, 11), ("code", code_train, 12)):
            mixed = mixed_style_rows(rows, bare_fraction, random.Random(seed * 1000 + offset))
            write_jsonl(out / f"{name}_train_mixed.jsonl", mixed)
            written.append(out / f"{name}_train_mixed.jsonl")
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
    ap.add_argument("--level", default="worked", choices=sorted(MATH_KINDS),
                    help="task mix: worked (the shipped data), easy (bare answers) or hard (multi-step)")
    ap.add_argument("--fact-repeats", type=int, default=0,
                    help="copies of the one-digit fact questions (`fact_rows`) added to math_train")
    ap.add_argument("--bare-fraction", type=float, default=0.5,
                    help="share of bare responses in {math,code}_train_mixed.jsonl (worked level only)")
    args = ap.parse_args(argv)
    for p in generate(args.out, args.seed, args.n_train, args.n_eval, args.n_cpt, args.level, args.fact_repeats,
                      args.bare_fraction):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
