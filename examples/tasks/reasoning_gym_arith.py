"""SFT rows for reasoning-gym's `basic_arithmetic` task in the form the tiny model can learn.

    python examples/tasks/reasoning_gym_arith.py --out examples/data/rg_arith_sft.jsonl

The questions are reasoning-gym's own (`reasoning_gym.create_dataset("basic_arithmetic", ...)` with two
two-digit terms, + and -, no parentheses or negation: `Calculate 95 - 21.`); only the responses are ours:
the column working the shipped tiny model was trained on (`examples/tasks/generate.py`), then the boxed
answer, `1+5=6 9-2=7 \\boxed{74}`. A ~1.4M-parameter model cannot subtract two-digit numbers in one step from
characters; with the working each column is a one-digit fact. The held-out rows (`RG_EVAL`, another seed)
are reasoning-gym's too; a question that is also held out is dropped from these rows (2 two-digit terms and
two operators make only 16,200 questions, so seeds alone would overlap), and the RL prompts of
`recipes/rl_tiny_reasoning_gym.yaml` are these rows' questions.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import column_add, column_sub  # noqa: E402

TASK = "min_terms=2&max_terms=2&min_digits=2&max_digits=2&operators=[+,-]&allow_parentheses=false&allow_negation=false"
RG_SFT = f"rg:basic_arithmetic?size=4000&seed=100&{TASK}"
RG_EVAL = f"rg:basic_arithmetic?size=200&seed=1&{TASK}"


def worked_response(expression: str) -> str:
    """`a + b` or `a - b` (two-digit a, b) -> the column working and the boxed value."""
    a_s, op, b_s = expression.split()
    a, b = int(a_s), int(b_s)
    if op == "+":
        return f"{column_add(a, b)} \\boxed{{{a + b}}}"
    if op != "-":
        raise ValueError(f"only + and - are worked: {expression!r}")
    work = column_sub(a, b) if a >= b else f"-({b}-{a}): {column_sub(b, a)}"
    return f"{work} \\boxed{{{a - b}}}"


def sft_rows(spec: str = RG_SFT, held_out: str = RG_EVAL) -> list[dict]:
    """reasoning-gym rows of `spec` whose question is not one of `held_out`'s, with a worked `response` each
    (checked by the task's own verifier)."""
    from ebpo.infra.task_libraries import load_rg
    from rewards.reasoning_gym_reward import reasoning_gym_score

    rows, exclude = [], {r["prompt"] for r in load_rg(held_out)}
    for row in load_rg(spec):
        if row["prompt"] in exclude:
            continue
        response = worked_response(row["metadata"]["expression"])
        score = reasoning_gym_score(completion=response, answer=row["answer"], metadata=row["metadata"],
                                    prompt=row["prompt"]).score
        if score != 1.0:
            raise AssertionError(f"worked response {response!r} fails reasoning-gym's check for {row['prompt']!r}")
        rows.append({**row, "response": response})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/data/rg_arith_sft.jsonl")
    args = ap.parse_args(argv)
    rows = sft_rows()
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.out} (questions also held out in {RG_EVAL} dropped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
