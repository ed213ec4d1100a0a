"""A sanity-check reward for the RL loop: 1.0 when the boxed answer is an even integer, else 0.0.

It asks for something the policy can already do by chance (about half of its answers are even), so a
working RL loop must raise it within a few steps; the task reward cannot tell a broken loop from a
model that has nothing to learn quickly. Run it in place of the quickstart's rewards:

    ebpo train recipes/quickstart.yaml "reward.fns=[{fn: examples/rewards/even_answer.py:even_answer}]" \\
        trainer.steps=20 trainer.eval_every=0 trainer.tracking=none

`eval/accuracy` is then the fraction of held-out prompts answered with an even number (greedy).
"""
from __future__ import annotations

import re

_BOXED_INT = re.compile(r"\\boxed\{(-?\d+)\}")


def even_answer(*, completion: str, **_) -> float:
    """1.0 if the first `\\boxed{N}` holds an even integer N, else 0.0."""
    m = _BOXED_INT.search(completion or "")
    return float(bool(m) and int(m.group(1)) % 2 == 0)
