"""The fair test of Levenshtein editing (issue 36; docs/levenshtein_fair_test.md): copy or reverse a random string.

    python examples/tasks/lev_fair.py --out examples/data          # lev_fair_{train,eval}.jsonl (seed 0)
    python examples/tasks/lev_fair.py --out examples/data --kinds Copy --exclude examples/data/lev_fair_train.jsonl
                                                                   # lev_fair_copy_{train,eval}.jsonl: the task run

Row: `{"prompt": "Copy: qhzkx...", "answer": "qhzkx...", "response": "qhzkx...", "task": "lev_fair"}` (or
`Reverse: ...` with the reversed string). Strings are 12 to 40 lowercase letters, so an answer spans one to three
blocks of 16 after the prompt's tail, and a dropped or repeated letter moves every letter after it: the error
Levenshtein editing is for. Held-out strings never occur in the training split. The same seed gives
byte-identical files.

`error_kind(output, reference)` classifies a wrong answer: `shift` when every cheapest edit script from the
output to the reference needs an insertion or a deletion (the lengths differ, or the edit distance is below the
count of mismatched positions), `substitution` when position-by-position rewriting is as cheap as anything.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
KINDS = ("Copy", "Reverse")  # the default mix (the first design); "Squeeze" is the task the test ran (page)
ALL_KINDS = KINDS + ("Squeeze",)


def squeeze_source(rng: random.Random, answer: str, max_run: int = 2) -> str:
    """The prompt string of a Squeeze row: each letter of `answer` repeated 1..max_run times (uniform)."""
    return "".join(c * rng.randint(1, max_run) for c in answer)


def random_runs_answer(rng: random.Random, n: int) -> str:
    """n letters of ALPHABET, no letter equal to the one before it (so that each is its own run)."""
    out: list[str] = []
    while len(out) < n:
        c = rng.choice(ALPHABET)
        if not out or c != out[-1]:
            out.append(c)
    return "".join(out)


def make_row(rng: random.Random, min_len: int = 12, max_len: int = 40, kinds: tuple[str, ...] = KINDS) -> dict:
    """One row of a kind drawn uniformly from `kinds`. Copy / Reverse: a string of min_len..max_len letters of
    ALPHABET, copied or reversed. Squeeze: an answer of min_len..max_len letters, no two neighbours equal, and the
    prompt string holds each of its letters 1 or 2 times in a row; the answer squeezes every run to one letter."""
    if "Squeeze" in kinds:
        if len(kinds) > 1:
            raise ValueError(f"lev_fair: Squeeze is a task of its own, not mixed with other kinds (got {kinds})")
        ans = random_runs_answer(rng, rng.randint(min_len, max_len))
        return {"prompt": f"Squeeze: {squeeze_source(rng, ans)}", "answer": ans, "response": ans, "task": "lev_fair"}
    s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len)))
    kind = rng.choice(kinds)
    ans = s if kind == "Copy" else s[::-1]
    return {"prompt": f"{kind}: {s}", "answer": ans, "response": ans, "task": "lev_fair"}


def make_splits(n_train: int, n_eval: int, seed: int = 0, min_len: int = 12, max_len: int = 40,
                kinds: tuple[str, ...] = KINDS, exclude: frozenset[str] = frozenset()
                ) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows); held-out prompts are drawn first and never repeat, occur in train or are in
    `exclude` (prompts some earlier training data held, so that no model meets a held-out row in training)."""
    rng = random.Random(seed)
    held, seen = [], set(exclude)
    while len(held) < n_eval:
        r = make_row(rng, min_len, max_len, kinds)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            held.append(r)
    train = []
    while len(train) < n_train:
        r = make_row(rng, min_len, max_len, kinds)
        if r["prompt"] not in seen:
            train.append(r)
    return train, held


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (unit insert, delete, substitute) by the textbook O(len a * len b) table."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return prev[-1]


def error_kind(output: str, reference: str) -> str:
    """`correct`, `shift` (lengths differ, or edit distance < mismatched positions) or `substitution`."""
    if output == reference:
        return "correct"
    if len(output) != len(reference):
        return "shift"
    hamming = sum(x != y for x, y in zip(output, reference))
    return "shift" if edit_distance(output, reference) < hamming else "substitution"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="examples/data")
    ap.add_argument("--train", type=int, default=10000)
    ap.add_argument("--eval", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-len", type=int, default=12, help="shortest answer (letters)")
    ap.add_argument("--max-len", type=int, default=40, help="longest answer (letters)")
    ap.add_argument("--kinds", nargs="+", choices=ALL_KINDS, default=list(KINDS),
                    help="task kinds; with one kind the files are named lev_fair_<kind>_{train,eval}.jsonl")
    ap.add_argument("--exclude", nargs="*", default=[],
                    help="jsonl files whose prompts the held-out split must avoid (earlier training data)")
    args = ap.parse_args()
    exclude = frozenset(json.loads(line)["prompt"] for f in args.exclude for line in open(f) if line.strip())
    train, held = make_splits(args.train, args.eval, args.seed, args.min_len, args.max_len, tuple(args.kinds), exclude)
    stem = "lev_fair" if len(args.kinds) > 1 else f"lev_fair_{args.kinds[0].lower()}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in ((f"{stem}_train", train), (f"{stem}_eval", held)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
