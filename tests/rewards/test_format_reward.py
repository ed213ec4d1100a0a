"""The format rewards (rewards/format_reward.py): what passes and fails each form check; and every parse of
policy text in the reward process is linear: a megabyte of each nasty shape parses in well under a second (the
old fence regex took 15-36 s on 160 kB), and the scanner gives what the regex it replaced gave on small random
texts (`code_blocks`, `last_boxed`, and `rewards.code_reward.extract_code`, which reads the same fences)."""
import random
import re
import time

import pytest

from rewards import load_reward
from rewards.code_reward import extract_code
from rewards.format_reward import code_blocks, format_boxed, format_code, last_boxed


def test_format_rewards():
    fb, fc, f = load_reward("format_boxed"), load_reward("format_code"), load_reward("format")
    assert fb(completion="so \\boxed{\\frac{1}{2}}").score == 1.0
    assert fb(completion="so \\boxed{}").score == 0.0
    assert fb(completion="so \\boxed{12").score == 0.0
    assert fb(completion="160").score == 0.0
    assert fc(completion="```python\nprint(1)\n```").score == 1.0
    assert fc(completion="```\nprint(1)\n```").score == 1.0
    assert fc(completion="```rust\nfn main(){}\n```").score == 0.0
    assert fc(completion="print(1)").score == 0.0
    assert f(completion="```py\nx=1\n```", kind="code").score == 1.0
    with pytest.raises(ValueError, match="kind"):
        f(completion="", kind="nope")


MB = 1 << 20


HONEST = "```python\ndef add(a, b):\n    return a + b\n```\n"


NASTY = {
    "fence_then_word_chars": "```" + "a" * MB,
    "fence_then_long_header": "```python" + "x" * MB + "\n",
    "fence_then_blanks": "```" + " \t" * (MB // 2) + "\n",
    "fences_only": "```" * (MB // 3),
    "backticks": "`" * MB,
    "two_ticks_newlines": "``\n" * (MB // 3),
    "openers_without_closers": "```py\n" + "```" + "p" * MB,
    "empty_blocks": "```\n" * (MB // 4),
    "boxed_repeated": "\\boxed{" * (MB // 7),
    "boxed_open_braces": "\\boxed{" + "{" * MB,
    "boxed_alternating": "\\boxed{" + "{}" * (MB // 2),
}


# the regex the fence scanner replaced (quadratic on a fence followed by a long line), as the oracle
OLD_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


@pytest.mark.parametrize("shape", sorted(NASTY))
def test_a_megabyte_of_each_nasty_shape_parses_in_linear_time(shape):
    text = HONEST + NASTY[shape]
    t0 = time.perf_counter()
    code = extract_code(text)
    code_ok = format_code(completion=text).score
    boxed = format_boxed(completion=text).score
    last_boxed(text)
    seconds = time.perf_counter() - t0
    assert seconds < 2.0, (shape, seconds)
    if not shape.startswith(("fence", "openers", "empty", "fences", "two")):
        assert code == "def add(a, b):\n    return a + b\n" and code_ok == 1.0, shape
    assert boxed == 0.0


def test_the_scanner_finds_what_the_regex_found():
    pieces = ["`", "`", "```", "\n", "py", "python", " ", "\t", "x", "```python\n", "```\n", "#"]
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        assert code_blocks(text) == [(m.group(1).lower(), m.group(2)) for m in OLD_FENCE.finditer(text)], text


def test_boxed_is_still_balanced():
    assert last_boxed("a \\boxed{x} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed {") is None
