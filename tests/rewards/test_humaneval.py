"""HumanEval through the code reward (slow): every canonical solution passes, wrong variants fail.

The tests run in the judge and call the candidate across the plain-data channel; HumanEval's own
``check(candidate)`` programs must still work that way, and hostile variants (a return value that
equals anything, builtins shadowed at module level, a bare ``return None``, the prompt's helpers
redefined with the entry point as identities) must score below 1 on every problem.
"""
import concurrent.futures as cf
import gzip
import json
import os

import pytest

from rewards.code_reward import code_reward
from rewards.prompt_helpers import prompt_helpers

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "HumanEval.jsonl.gz")
with gzip.open(DATA, "rt") as f:
    PROBLEMS = [json.loads(line) for line in f]
KW = dict(test_timeout_s=10.0, total_timeout_s=60.0)
EQ_ANY = ("    class _Any:\n        def __eq__(self, other):\n            return True\n"
          "        __ne__ = lambda self, other: False\n    return _Any()\n")
SHADOW = ("range = lambda *a: []\nlen = lambda x: 0\nall = any = lambda x: True\nzip = lambda *a: []\n"
          "abs = lambda x: 0\n")
# the entry point and every helper the prompt defines, redefined as identities (HumanEval/32, /38, /50
# passed this way when the judge took the helpers from the candidate)
REDEFINE = lambda p: "".join(f"def {name}(*a):\n    return a[0] if a else None\n"  # noqa: E731
                             for name in sorted(prompt_helpers(p["prompt"]).names | {p["entry_point"]}))
WRONG = {"return_none": lambda p: p["prompt"] + "    return None\n",
         "redefined_helpers": REDEFINE,
         "equal_to_anything": lambda p: p["prompt"] + EQ_ANY,
         "shadowed_builtins": lambda p: SHADOW + p["prompt"] + "    return None\n"}


def _score(problem, code):
    test = problem["test"] + f"\ncheck({problem['entry_point']})\n"
    return code_reward(completion=code, tests=[test], prompt=problem["prompt"], **KW)


def _all(code_of):
    with cf.ThreadPoolExecutor(2) as ex:
        return list(ex.map(lambda p: (p["task_id"], _score(p, code_of(p))), PROBLEMS))


@pytest.mark.slow
def test_canonical_solutions_all_pass():
    bad = [(k, o.score, o.extras.get("outcomes")) for k, o in _all(lambda p: p["prompt"] + p["canonical_solution"])
           if o.score != 1.0]
    assert len(PROBLEMS) == 164 and bad == []


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(WRONG))
def test_known_wrong_variants_fail(variant):
    passed = [k for k, o in _all(WRONG[variant]) if o.score == 1.0]
    assert passed == []
