"""A user reward, loaded by path: partial credit for the column working of the synthetic arithmetic task.

    reward:
      fns:
        - {fn: math, weight: 1.0}
        - {fn: examples/rewards/column_working.py:column_working, weight: 0.5}

The `math` reward is 1 only when the boxed answer is right, which a tiny model gets for a few percent of
samples: most groups of G samples then score all zeros and carry no GRPO signal. This reward scores each
column step of the working (`4+7=11 7+2+1=10 \\boxed{101}`) against the steps it should have, derived
here from the numbers in the prompt, so every group has variance and the facts the model gets wrong are
the ones that cost it reward.

It cannot be gamed by writing true but irrelevant equations: step i must be exactly the expected text
for the prompt's operands. It needs nothing but the standard library (a reward file may import only
`rewards` of ours).
"""
from __future__ import annotations

import re

_WORD_FIND = re.compile(r"has (\d+) \w+ and finds (\d+)\.")
_WORD_GIVE = re.compile(r"has (\d+) \w+ and gives away (\d+)\.")
_COMPUTE = re.compile(r"Compute (\d+)([+\-*])(\d+)\.")
_FACT = re.compile(r"Compute (\d+(?:[+\-*]\d+){1,2})\.")


def _add_steps(a: int, b: int) -> list[str]:
    ones = a % 10 + b % 10
    tens_lhs = f"{a // 10}+{b // 10}" + (f"+{ones // 10}" if ones >= 10 else "")
    return [f"{a % 10}+{b % 10}={ones}", f"{tens_lhs}={a // 10 + b // 10 + ones // 10}"]


def _sub_steps(a: int, b: int) -> list[str]:
    """a >= b; a borrow shows as `13-8=5 7-2-1=4`."""
    top = a % 10 if a % 10 >= b % 10 else a % 10 + 10
    borrow = int(top != a % 10)
    tens_lhs = f"{a // 10}-{b // 10}" + ("-1" if borrow else "")
    return [f"{top}-{b % 10}={top - b % 10}", f"{tens_lhs}={a // 10 - b // 10 - borrow}"]


def _mul_steps(a: int, d: int) -> list[str]:
    ones = (a % 10) * d
    tens_lhs = f"{a // 10}*{d}" + (f"+{ones // 10}" if ones >= 10 else "")
    return [f"{a % 10}*{d}={ones}", f"{tens_lhs}={(a // 10) * d + ones // 10}"]


def expected_steps(prompt: str) -> list[str] | None:
    """The working steps, in order, for a prompt of the synthetic math task; None for other prompts."""
    if m := _WORD_FIND.search(prompt):
        return _add_steps(int(m[1]), int(m[2]))
    if m := _WORD_GIVE.search(prompt):
        return _sub_steps(int(m[1]), int(m[2]))
    m = _COMPUTE.search(prompt)
    if m and int(m[1]) >= 10 and (m[2] == "*" or int(m[3]) >= 10):  # a two-digit question: its columns
        a, op, b = int(m[1]), m[2], int(m[3])
        if op == "+":
            return _add_steps(a, b)
        if op == "*":
            return _mul_steps(a, b)
        return _sub_steps(a, b) if a >= b else [f"-({b}-{a}):", *_sub_steps(b, a)]
    if m := _FACT.search(prompt):  # a one-step fact (`Compute 4+7.`, `Compute 7+2+1.`): the step itself
        return [f"{m[1]}={_value(m[1])}"]
    return None


def _value(expr: str) -> int:
    """Value of digits joined by + - * with * first (no eval of model- or user-controlled text)."""
    total = 0
    for sign, term in re.findall(r"([+-]?)(\d+(?:\*\d+)*)", expr):
        prod = 1
        for f in term.split("*"):
            prod *= int(f)
        total += -prod if sign == "-" else prod
    return total


def column_working(*, prompt: str, completion: str, **_) -> float:
    """Fraction in [0, 1] of the expected working steps that the completion writes, each compared at its
    own place (whitespace-separated item i against step i); 0.0 for prompts it does not know."""
    steps = expected_steps(prompt or "")
    if not steps:
        return 0.0
    written = (completion or "").split()
    return sum(w == s for w, s in zip(written, steps)) / len(steps)
