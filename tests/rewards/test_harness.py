"""rewards/_harness.py with the judge and the parent: the harness bounds a program's stdout in raw bytes and
sends it as escaped JSON; every bound after it (the judge's line, the parent's verdict line) allows for the
escape, so an honest program within the documented bound (`max_output_bytes`, 1 MiB) is judged on its output,
in every sandbox mode here."""
import pytest

from rewards.code_reward import code_reward
from rewards.sandbox import Limits, mode_works, resolve_mode, run_tests

MODES = [m for m in ("bwrap", "unshare", "rlimits") if m == "rlimits" or mode_works(m)]
MIB = 1 << 20


def _printer(parts):
    """A program that writes `parts` (text, count) to stdout, then a newline; its raw size in bytes."""
    body = " + ".join(f"{text!r} * {n}" for text, n in parts)
    raw = sum(len(text.encode()) * n for text, n in parts) + 1
    return f"import sys\nsys.stdout.write({body} + '\\n')\n", raw


# escaped as JSON: a control byte costs 6 bytes, 'é' 6 for 2, an emoji 12 for 4: about 5 MiB of record
HEAVY = [("\x01", 580_000), ("é", 150_000), ("\U0001F600", 40_000), ("x", 8000)]


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_program_printing_escaped_text_up_to_the_bound_scores_one(mode):
    prog, raw = _printer(HEAVY)
    assert MIB - 1000 < raw <= MIB  # within the documented bound, close to it
    expected = "".join(text * n for text, n in HEAVY)
    out = code_reward(completion=prog, tests=[{"input": "", "output": expected}, {"input": "", "output": "no"}],
                      sandbox=mode, test_timeout_s=10.0, total_timeout_s=20.0)
    assert out.extras["outcomes"] == ["ok", "wrong_output"] and out.score == 0.5


@pytest.mark.parametrize("mode", MODES)
def test_output_over_the_bound_fails_that_test_only(mode):
    prog, raw = _printer([("\x01", MIB)])
    assert raw > MIB
    tests = [{"input": "", "output": "\x01" * MIB}, {"input": "", "output": "\x01" * MIB}]
    honest = "print('ok')"
    out = code_reward(completion=prog, tests=tests, sandbox=mode, test_timeout_s=10.0, total_timeout_s=20.0)
    assert out.score == 0.0 and out.extras["outcomes"] == ["output_limit", "output_limit"]
    assert code_reward(completion=honest, tests=[{"input": "", "output": "ok"}], sandbox=mode).score == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_text_of_wide_characters_comes_back_whole(mode):
    """A capture test (a sandboxed tool's stdout) of 20,000 emoji: a 240 kB verdict line for the parent."""
    prog, _ = _printer([("\U0001F600", 20_000)])
    outputs = []
    verdicts = run_tests(prog, [{"kind": "stdio", "stdin": "", "capture": 20_000}], Limits(test_timeout_s=10),
                         resolve_mode(mode), outputs)
    assert verdicts == [(True, "ok")] and outputs == ["\U0001F600" * 20_000]
