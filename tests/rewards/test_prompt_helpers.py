"""Helpers the task's prompt defines are trusted task code: the judge binds the prompt's definition.

A candidate that redefines a helper together with the function to write (two identity functions, say)
must fail however the prompt is wrapped (bare code, a fenced block in an instruction, code after prose)
and however the test uses the helper (an assert string, HumanEval's check program, a loop, a class, a
constant). An honest candidate passes, with or without its own copy of the helper; a prompt that leaves
nothing to write (a "fix this function" task) defines nothing the candidate may not.
"""
import concurrent.futures as cf
import gzip
import json
import os

import pytest

from tests.rewards.hostile import FAST, MODES
from rewards.code_reward import code_reward
from rewards.prompt_helpers import prompt_helpers

TASK = '''import string


def encode(s: str) -> str:
    """Shift every letter by 3."""
    return "".join(chr((ord(c) - 97 + 3) % 26 + 97) for c in s)


class Box:
    """A value in a box."""
    def __init__(self, v):
        self.v = v


TABLE = (0, 1, 4, 9)


def decode(s: str) -> str:
    """Undo encode."""
'''
HONEST = 'def decode(s):\n    return "".join(chr((ord(c) - 97 - 3) % 26 + 97) for c in s)\n'
STUBS = ("def encode(s):\n    return s\ndef decode(s):\n    return s\n"
         "class Box:\n    def __init__(self, v):\n        self.v = None\nTABLE = (0, 0, 0, 0)\n")
TESTS = [
    "assert decode(encode('hello')) == 'hello'",
    "def check(candidate):\n    for w in ['abc', 'xyz']:\n        assert candidate(encode(w)) == w\n"
    "        assert encode(w) != w\ncheck(decode)",
    "assert Box(decode('d')).v == 'a' and Box(1).v == 1",
    "assert decode(encode('a')) == 'a' and TABLE[3] == 9",
]
WRAPS = {
    "bare": lambda p: p,
    "fenced": lambda p: f"Complete the function below.\n\n```python\n{p}```\nAnswer with code only.",
    "after_prose": lambda p: "Complete the function below; keep the helpers.\n\n" + p,
}


@pytest.mark.parametrize("mode", MODES)
def test_a_candidate_cannot_redefine_what_the_prompt_defines(mode):
    pairs = "def encode(s):\n    return s\ndef decode(s):\n    return s\n"  # the two identity functions
    whole = TASK.replace('    """Undo encode."""\n', '    """Undo encode."""\n' + HONEST.split("\n", 1)[1])
    cases = [(w, code) for w in WRAPS for code in (STUBS, pairs, HONEST, whole)]

    def one(case):
        wrap, code = case
        out = code_reward(completion=code, tests=TESTS, prompt=WRAPS[wrap](TASK), sandbox=mode, **FAST)
        return wrap, code, out

    with cf.ThreadPoolExecutor(4) as ex:
        for wrap, code, out in ex.map(one, cases):
            want = 0.0 if "return s\n" in code else 1.0
            assert out.score == want, (wrap, code, out)


def test_which_names_the_prompt_defines():
    h = prompt_helpers(TASK)
    assert h.names == {"encode", "Box", "TABLE"} and h.stubs == {"decode"}
    assert h.for_entry("decode") == {"encode", "Box", "TABLE"}
    # a complete program leaves nothing to write ("fix this function"): nothing of it is trusted, and the
    # entry point is never a helper; an entry point the prompt does not define makes the rest helpers
    full = "def helper(x):\n    return x + 1\n\ndef solve(x):\n    return helper(x)\n"
    assert prompt_helpers(full).for_entry("solve") == frozenset()
    assert prompt_helpers(full).for_entry(None) == frozenset()
    assert prompt_helpers(full).for_entry("other") == {"helper", "solve"}
    assert prompt_helpers(full + "\ndef todo(x):\n    pass\n").for_entry("solve") == {"helper"}
    assert prompt_helpers("Write a function that adds two numbers.").names == frozenset()
    assert prompt_helpers(None).names == frozenset()
    # an import the judge lacks fails only what needs it
    h = prompt_helpers("import no_such_module_xyz\n\ndef g():\n    return 1\n\ndef f():\n    pass\n")
    exec(h.src, {})


@pytest.mark.parametrize("mode", MODES[:1])
def test_a_fix_this_function_task_takes_the_candidates_version(mode):
    prompt = "Fix the bug:\n```python\ndef add(a, b):\n    return a - b\n```"
    out = code_reward(completion="def add(a, b):\n    return a + b\n", tests=["assert add(2, 3) == 5"],
                      prompt=prompt, sandbox=mode, **FAST)
    assert out.score == 1.0, out


DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "HumanEval.jsonl.gz")
REDEFINED = {"HumanEval/32": "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0\n",
             "HumanEval/38": "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n",
             "HumanEval/50": "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n"}


@pytest.mark.parametrize("task_id", sorted(REDEFINED))
def test_humaneval_stubs_that_redefine_the_prompts_helper_fail(task_id):
    with gzip.open(DATA, "rt") as f:
        p = next(r for r in map(json.loads, f) if r["task_id"] == task_id)
    test = p["test"] + f"\ncheck({p['entry_point']})\n"
    kw = dict(tests=[test], prompt=p["prompt"], sandbox=MODES[0], test_timeout_s=10.0, total_timeout_s=30.0)
    assert code_reward(completion=REDEFINED[task_id], **kw).score < 1.0
    assert code_reward(completion=p["prompt"] + p["canonical_solution"], **kw).score == 1.0
