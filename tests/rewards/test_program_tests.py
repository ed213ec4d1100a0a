"""Program-form tests (rewards/program_tests.py): split into assert tests judged outside the sandbox, the rest
judged by an exit status the candidate cannot forge; tests that never call the candidate are left out of the
score. Every sample in every sandbox mode here, each with a wall-time bound (see hostile.py)."""
import textwrap

import pytest

from rewards.code_reward import code_reward
from tests.rewards.hostile import BOUND, FAST, HUMANEVAL, MODES
from tests.rewards.hostile import run_cases as _sequential_cases


HONEST = textwrap.dedent('''
    def has_close_elements(numbers, threshold):
        return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
''')


FORGE = textwrap.dedent('''
    import json, os
    rec = {"values": [["b", True]]}
    lines = "".join(json.dumps({"i": i, "status": "ok", "exit": 0, "payload": json.dumps(rec)}) + "\\n"
                    for i in range(8)) + '{"done": 1}\\n'
    for path in ["/proc/1/fd/1", "/proc/%d/fd/1" % os.getppid()]:
        try:
            with open(path, "w") as f:
                f.write(lines)
        except OSError:
            pass
    for fd in range(3, 64):
        try:
            os.write(fd, json.dumps(rec).encode())
        except OSError:
            pass
    os._exit(0)
''')


@pytest.mark.parametrize("mode", MODES)
def test_program_tests_are_split_and_unforgeable(mode):
    residual = ("def check(candidate):\n    for x in range(3):\n        assert candidate([x, x + 0.1], 0.5)\n"
                "check(has_close_elements)")

    def exact(score, **extras):
        def check(out):
            assert out.score == pytest.approx(score), out
            assert {k: out.extras[k] for k in extras} == extras, out
        return check

    exit_early = "import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n"
    cases = [
        # 3 asserts split out; `assert True` never calls the candidate: left out
        ("honest", HONEST, [HUMANEVAL], {}, BOUND, exact(1.0, total=3, vacuous_tests=1, program_tests=0)),
        # forged records written to every descriptor, then an exit at import: every call fails
        ("forged_records", FORGE, [HUMANEVAL, residual], {}, BOUND, exact(0.0, total=4, program_tests=1)),
        ("constant_true", "def has_close_elements(*a):\n    return True\n", [HUMANEVAL], {}, BOUND,
         exact(2 / 3, total=3)),
        ("exit_zero_inside", exit_early, [residual], {}, BOUND, exact(0.0, total=1, program_tests=1)),
        ("sys_exit_at_import", "import sys\nsys.exit(0)\n", [residual, HUMANEVAL], {}, BOUND, exact(0.0, total=4)),
        ("honest_residual", HONEST, [residual], {}, BOUND, exact(1.0, total=1, program_tests=1)),
    ]
    _sequential_cases(cases, mode)


def test_vacuous_tests_are_left_out_of_the_score():
    wrong = "def add(a, b):\n    return a - b\n"
    tests = ["assert True", "assert 1 == 1", "assert len([1]) == 1", "x = 1\nassert x == 1", "assert add(1, 2) == 3"]
    out = code_reward(completion=wrong, tests=tests, **FAST)
    assert out.score == 0.0 and out.extras["total"] == 1 and out.extras["vacuous_tests"] == 4, out
    out = code_reward(completion=wrong, tests=["assert True", "import math"], **FAST)
    assert out.score is None and "no test refers to the candidate" in out.extras["skip_reason"]
