"""Rules of the judge and of plain data that no happy-path test pins (issue 40).

* stdin/stdout tests compare the output exactly as documented (rewards/code_tests.py): line endings and
  trailing whitespace (of each line, and trailing blank lines) are normalised, nothing else: leading
  whitespace, inner blank lines and every other character count;
* the plain-data item bound (rewards/_plain.py, docs/rewards.md: 262,144 items) holds through every container,
  dict keys and values included: a value of exactly the bound decodes, one item more is refused, wherever
  the items sit.
"""
import json
import random

import pytest

from rewards import _plain
from rewards._plain import PLAIN_MAX_ITEMS, PlainError, plain_decode, plain_encode
from rewards.code_reward import code_reward

OUT = "  12 ab\n\tx  y\n\n   \nlast line\n"  # what the candidate prints: leading blanks, an inner blank line


def _lines(text):
    """The documented comparison, read literally: lines (any line ending) without trailing blanks, and no
    trailing blank lines."""
    lines = [ln.rstrip(" \t\f\v") for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _variants(rng):
    """Expected outputs derived from OUT by edits the rule normalises and edits it does not."""
    lines = OUT.split("\n")
    same, differ = [], []
    for _ in range(6):
        ls = list(lines)
        i = rng.randrange(len(ls))
        ls[i] = ls[i] + rng.choice([" ", "\t", "  \t"])  # trailing whitespace on a line
        same.append("\n".join(ls))
    same += [OUT.replace("\n", "\r\n"), OUT.replace("\n", "\r"), OUT.rstrip("\n"), OUT + "\n\n  \n", OUT.rstrip()]
    text_lines = [i for i, ln in enumerate(lines) if ln.strip()]
    for i in text_lines:
        ls = list(lines)
        ls[i] = " " + ls[i]  # one more leading blank
        differ.append("\n".join(ls))
        if ls[i][1] in " \t":
            ls = list(lines)
            ls[i] = ls[i][1:]  # one leading blank fewer
            differ.append("\n".join(ls))
    differ += [OUT.replace("\n\n", "\n", 1),  # the inner blank line dropped
               OUT.replace("ab", "a b"), OUT.replace("x  y", "x y"), "\n" + OUT, OUT.replace("\t", "    ", 1)]
    return same, differ


def test_stdio_output_is_compared_as_documented_leading_whitespace_matters():
    rng = random.Random(40)
    same, differ = _variants(rng)
    for e in same:
        assert _lines(e) == _lines(OUT), repr(e)
    for e in differ:
        assert _lines(e) != _lines(OUT), repr(e)
    prog = f"import sys\nsys.stdout.write({OUT!r})\n"
    tests = [{"input": "", "output": e} for e in same + differ]
    out = code_reward(completion=prog, tests=tests, sandbox="rlimits", test_timeout_s=5.0, total_timeout_s=60.0)
    want = ["ok"] * len(same) + ["wrong_output"] * len(differ)
    assert out.extras["outcomes"] == want, [(t["output"], o) for t, o in zip(tests, out.extras["outcomes"])
                                             if (o == "ok") != (t["output"] in same)]


def _count(tagged):
    """Items of a tagged value as the bound counts them: every scalar and every container, keys included."""
    tag = tagged[0]
    if tag in ("l", "t", "S", "F"):
        return 1 + sum(_count(x) for x in tagged[1])
    if tag == "d":
        return 1 + sum(_count(k) + _count(v) for k, v in tagged[1])
    return 1


def _holder(where, n):
    """A tagged value of exactly `n` items whose bulk sits in `where`: a list, tuple, set, frozenset, a dict's
    keys (tuples), a dict's values, or nested a few levels down."""
    ints = lambda k, off=0: [["i", str(off + i)] for i in range(k)]  # noqa: E731
    if where in ("l", "t", "S", "F"):
        return [where, ints(n - 1)]
    if where == "dict_keys":  # one key: a tuple of n - 3 ints; its value None -> 1 + (1 + n - 3) + 1
        return ["d", [[["t", ints(n - 3)], ["n"]]]]
    if where == "dict_values":
        return ["d", [[["s", "k"], ["l", ints(n - 3)]]]]
    if where == "many_keys":  # (n - 1) / 2 int keys with None values, plus one filler item when n is even
        pairs = [[["i", str(i)], ["n"]] for i in range((n - 1) // 2)]
        if (n - 1) % 2:
            pairs[0][1] = ["l", [["n"]]]
        return ["d", pairs]
    if where == "nested":  # list > dict value > tuple > set of ints
        return ["l", [["d", [[["s", "a"], ["t", [["S", ints(n - 5)]]]]]]]]
    raise AssertionError(where)


WHERE = ["l", "t", "S", "F", "dict_keys", "dict_values", "many_keys", "nested"]


def _check_bound(where, bound):
    for n in (bound - 1, bound, bound + 1):
        v = _holder(where, n)
        assert _count(v) == n
        if n <= bound:
            plain_decode(v)
        else:
            with pytest.raises(PlainError, match="too large"):
                plain_decode(v)


@pytest.mark.parametrize("bound", [40, 301, 1024])
@pytest.mark.parametrize("where", WHERE)
def test_the_item_bound_holds_through_every_container(where, bound, monkeypatch):
    """Smaller bounds (the rule does not depend on the number) keep this fast; the documented bound below."""
    monkeypatch.setattr(_plain, "PLAIN_MAX_ITEMS", bound)
    _check_bound(where, bound)


@pytest.mark.parametrize("where", ["l", "dict_keys"])
def test_the_documented_item_bound(where):
    assert PLAIN_MAX_ITEMS == 262_144
    _check_bound(where, PLAIN_MAX_ITEMS)


@pytest.mark.parametrize("where", WHERE)
def test_the_bound_counts_the_whole_value_not_one_container(where, monkeypatch):
    """Two halves, each under the bound, together over it: refused (the count is shared, not per container)."""
    monkeypatch.setattr(_plain, "PLAIN_MAX_ITEMS", 500)
    half = 251
    v = ["l", [_holder(where, half), _holder(where, half)]]
    assert _count(v) == 2 * half + 1 > 500
    plain_decode(_holder(where, half))
    with pytest.raises(PlainError):
        plain_decode(v)


def test_a_decoded_value_under_the_bound_round_trips_through_json():
    v = {(1, 2): [None, True, 1.5, 2j, "s", b"\x00"], "k": ({3, 4}, frozenset({5}))}
    assert plain_decode(json.loads(json.dumps(plain_encode(v)))) == v
