import pytest

from rewards.math_reward import math_reward

# (gold, completion, expected verdict) written by hand from the mathematics, not from the code.
TABLE = [
    ("160", "The answer is \\boxed{160}", 1.0),
    ("160", "160", 1.0),
    ("160", "37*4 = 148, plus 12 gives 160.", 1.0),
    ("160", "\\boxed{161}", 0.0),
    ("160", "I think 160, no wait, 7", 0.0),       # last number wins
    ("160", "no idea", 0.0),
    ("1/2", "\\boxed{0.5}", 1.0),                    # fraction vs decimal
    ("0.5", "\\boxed{\\frac12}", 1.0),
    ("\\frac{1}{2}", "$\\frac{2}{4}$", 1.0),
    ("\\frac{1}{3}", "\\boxed{0.33}", 0.0),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", 1.0),      # sets ignore order
    ("\\{1,2\\}", "\\boxed{\\{1,3\\}}", 0.0),
    ("[0,1)", "\\boxed{[0,1)}", 1.0),               # intervals keep open/closed ends
    ("[0,1]", "\\boxed{[0,1)}", 0.0),
    ("2", "\\boxed{2} and 5", 1.0),                   # boxed wins over a later number
    ("-3", "\\boxed{-3}", 1.0),
    ("-3", "\\boxed{3}", 0.0),
    ("10^3", "\\boxed{1000}", 1.0),
]


@pytest.mark.parametrize("gold,completion,expected", TABLE)
def test_math_equivalence_table(gold, completion, expected):
    assert math_reward(completion=completion, answer=gold).score == expected


def test_missing_or_unparseable_gold_is_skip_not_zero():
    assert math_reward(completion="1", answer=None).score is None
    assert math_reward(completion="1", answer="   ").score is None


def test_runs_off_the_main_thread():
    import threading
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(completion="\\boxed{4}", answer="4")))
    t.start()
    t.join()
    assert out[0].score == 1.0
