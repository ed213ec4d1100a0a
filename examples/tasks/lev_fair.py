"""The fair test of Levenshtein editing (issue 36; docs/levenshtein_fair_test.md): copy or reverse a random string.

    python examples/tasks/lev_fair.py --out examples/data          # lev_fair_{train,eval}.jsonl (seed 0)

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
KINDS = ("Copy", "Reverse")


def make_row(rng: random.Random, min_len: int = 12, max_len: int = 40) -> dict:
    """One row: a string of min_len..max_len letters of ALPHABET, copied or reversed (each with probability 1/2)."""
    s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len)))
    kind = rng.choice(KINDS)
    ans = s if kind == "Copy" else s[::-1]
    return {"prompt": f"{kind}: {s}", "answer": ans, "response": ans, "task": "lev_fair"}


def make_splits(n_train: int, n_eval: int, seed: int = 0, min_len: int = 12, max_len: int = 40
                ) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows); held-out prompts are drawn first and never repeat or occur in train."""
    rng = random.Random(seed)
    held, seen = [], set()
    while len(held) < n_eval:
        r = make_row(rng, min_len, max_len)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            held.append(r)
    train = []
    while len(train) < n_train:
        r = make_row(rng, min_len, max_len)
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
    args = ap.parse_args()
    train, held = make_splits(args.train, args.eval, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("lev_fair_train", train), ("lev_fair_eval", held)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
