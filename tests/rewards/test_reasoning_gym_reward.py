"""rewards/reasoning_gym_reward.py: the answer is found in linear time, and reasoning-gym's verifier (third-party
code fed policy text) runs in the verifier sandbox, never in the reward process."""
import random
import re
import subprocess
import sys

from rewards.reasoning_gym_reward import extract_answer

# the regular expressions the scanner replaced (the lazy tag one is quadratic on openers without a closer), as
# the oracle for small texts
OLD_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
OLD_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _old_extract(text):
    for pattern in (OLD_TAG, OLD_BOXED):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return text.strip()


def test_the_scanner_finds_what_the_regex_found():
    pieces = ["<answer>", "</answer>", "<answer", "answer>", "</", "<", ">", "\\boxed{", "{", "}", " ", "\n",
              "7", "x"]
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 16)))
        assert extract_answer(text) == _old_extract(text), text


NASTY = {  # 1 MiB each (built in the child); the regex needs minutes on the first (74-91 s for 64k characters)
    "unclosed_tags": '"<answer>" * (1 << 17)',
    "unclosed_tags_then_text": '"<answer>" + "x" * (1 << 20)',
    "closers_only": '"</answer>" * (1 << 17)',
    "boxes": '"\\\\boxed{" * (1 << 17)',
    "tag_then_unclosed": '"<answer>42</answer>" + "<answer>" * (1 << 17)',
}


def test_a_megabyte_of_each_nasty_shape_parses_within_a_tight_timeout():
    """All shapes in one child process that must finish within 20 s (the linear scan takes milliseconds; the
    quadratic regex would need hours): a bound on the work, not a timing measurement."""
    code = ("from rewards.reasoning_gym_reward import extract_answer\n"
            f"shapes = [{', '.join(NASTY.values())}]\n"
            "print(repr([extract_answer(t)[:20] for t in shapes]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr[-2000:]
    got = eval(out.stdout)  # noqa: S307 - our own child's repr of a list of str
    assert got == [("<answer>" * 3)[:20], ("<answer>" + "x" * 19)[:20], ("</answer>" * 3)[:20],
                   ("\\boxed{" * 3)[:20], "42"]
