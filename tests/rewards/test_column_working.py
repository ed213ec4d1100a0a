"""The example user reward `examples/rewards/column_working.py`, loaded by path as a recipe would."""
import itertools
import json
import re
from pathlib import Path

import pytest

from rewards.loader import load_reward

ROOT = Path(__file__).resolve().parents[2]
REF = f"{ROOT / 'examples/rewards/column_working.py'}:column_working"


@pytest.fixture(scope="module")
def reward():
    return load_reward(REF)


def _eval_step(step: str) -> tuple[int, int]:
    lhs, rhs = step.split("=")
    assert re.fullmatch(r"\d+([+\-*]\d+)+", lhs), step
    return eval(lhs), int(rhs)  # noqa: S307 - digits and operators only (checked above)


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_every_operand_pair_has_true_steps_that_rebuild_the_answer(op):
    """Brute force over the task's whole range: each expected step is a true equation, and the ones digit
    of step 1 followed by step 2's value is the answer (the column method, checked by arithmetic)."""
    mod = load_reward(REF).__globals__
    seconds = range(2, 10) if op == "*" else range(10, 100)
    for a, b in itertools.product(range(10, 100), seconds):
        steps = mod["expected_steps"](f"Compute {a}{op}{b}.")
        work = steps[1:] if steps[0].startswith("-(") else steps
        (l1, r1), (l2, r2) = (_eval_step(s) for s in work)
        assert l1 == r1 and l2 == r2, (a, op, b, steps)
        value = int(f"{r2}{r1 % 10}")
        expect = {"+": a + b, "-": abs(a - b), "*": a * b}[op]
        assert value == expect, (a, op, b, steps)


def test_reference_responses_score_full_marks(reward):
    """The generator (an independent implementation of the same working) writes what the reward expects."""
    for name in ["math_train.jsonl", "math_eval.jsonl"]:
        for line in (ROOT / "examples/data" / name).read_text().splitlines()[:2000]:
            row = json.loads(line)
            assert reward(prompt=row["prompt"], completion=row["response"]) == 1.0, row


def test_partial_credit_and_no_credit_for_unrelated_true_equations(reward):
    prompt = "Compute 74+27."
    assert reward(prompt=prompt, completion="4+7=11 7+2+1=10 \\boxed{101}") == 1.0
    assert reward(prompt=prompt, completion="4+7=13 7+2+1=10 \\boxed{103}") == 0.5
    assert reward(prompt=prompt, completion="1+1=2 2+2=4 \\boxed{101}") == 0.0
    assert reward(prompt=prompt, completion="7+2+1=10 4+7=11") == 0.0  # steps out of order
    assert reward(prompt="Max has 19 books and finds 97. How many books?",
                  completion="9+7=16 1+9+1=11 \\boxed{116}") == 1.0
    assert reward(prompt="Compute 25-80.", completion="-(80-25): 10-5=5 8-2-1=5 \\boxed{-55}") == 1.0
    assert reward(prompt="Write f(x): take x, negate it.", completion="def f(x):\n    return -x") == 0.0
    assert reward(prompt=prompt, completion="") == 0.0
    # one-digit fact questions: the single step
    assert reward(prompt="Compute 4+7.", completion="4+7=11 \\boxed{11}") == 1.0
    assert reward(prompt="Compute 4*7+2.", completion="4*7+2=30 \\boxed{30}") == 1.0
    assert reward(prompt="Compute 13-8.", completion="13-8=6 \\boxed{6}") == 0.0
    assert reward(prompt="Compute 8-2-1.", completion="8-2-1=5 \\boxed{5}") == 1.0


def test_even_answer_sanity_reward():
    even = load_reward(f"{ROOT / 'examples/rewards/even_answer.py'}:even_answer")
    assert [even(completion=c) for c in ["7+5=12 \\boxed{12}", "\\boxed{-7}", "\\boxed{0}", "no answer", ""]] == \
        [1.0, 0.0, 1.0, 0.0, 0.0]
