"""The plain-data format between judge and candidate (rewards/_plain.py): exact builtin types only, and decoding
whose work is bounded whatever the bytes say (depth, items, number text, keys that share one hash).

* the limits at their exact boundaries: the text of one number, how many set members or dict keys may share one
  hash;
* the item bound (docs/rewards.md: 262,144 items) holds through every container, dict keys and values included:
  a value of exactly the bound decodes, one item more is refused, wherever the items sit;
* property tests (hypothesis): encode / JSON / decode round trips on random nested values give back the same
  value with the same exact types; decoding any JSON-like input either gives a plain value or raises PlainError
  (never another exception); the depth bound holds both ways.
"""
import json
import math
import time
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards import _plain
from rewards._plain import (PLAIN_MAX_DEPTH, PLAIN_MAX_ITEMS, PLAIN_MAX_NUMBER_CHARS, PLAIN_MAX_SAME_HASH,
                            PlainError, plain_decode, plain_encode)


VALUES = [None, True, 0, -7, 2 ** 100, 0.5, float("inf"), 1 + 2j, "", "text", b"\x00\xff", [], (1, "a"),
          {1, 2}, frozenset({3}), {"k": [1, {2: (3,)}]}, {(1, 2): None}]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_round_trip(value):
    wire = json.loads(json.dumps(plain_encode(value)))
    back = plain_decode(wire)
    assert back == value and type(back) is type(value)


def test_only_exact_builtin_types_are_plain():
    class Int(int):
        def __eq__(self, other):
            return True
    for bad in [Int(1), object(), range(3), iter([1]), [Int(2)], {"k": object()}, type]:
        with pytest.raises(PlainError):
            plain_encode(bad)


def test_decoding_work_is_bounded():
    p = 2 ** 61 - 1  # ints k * p all hash to 0: a set of n of them costs n^2 to build
    colliding = ["S", [["i", str(k * p)] for k in range(1, 30000)]]
    t0 = time.perf_counter()
    with pytest.raises(PlainError, match="one hash"):
        plain_decode(colliding)
    with pytest.raises(PlainError, match="one hash"):
        plain_decode(["d", [[["t", [["i", str(k * p)]]], ["n"]] for k in range(1, 30000)]])
    assert time.perf_counter() - t0 < 3.0  # building either would take minutes (n^2, n = 30,000)
    plain_decode(["S", [["i", str(k * p)] for k in range(1, PLAIN_MAX_SAME_HASH + 1)]])  # a few are fine
    assert len(plain_decode(["S", [["i", str(k)] for k in range(100000)]])) == 100000  # distinct: fine
    deep = ["n"]
    for _ in range(100):
        deep = ["l", [deep]]
    for bad in [deep, ["l", [["n"]] * (1 << 19)], ["i", "9" * 5000], ["f", "1" * 5000], ["S", [["l", []]]],
                ["d", [[["l", []], ["n"]]]], ["b", 1], ["q"], "n", [], ["i"], ["d", [["n"]]], ["y", "zz"]]:
        with pytest.raises(PlainError):
            plain_decode(bad)


# ---- the limits at their exact boundaries
P = 2**61 - 1  # CPython hashes ints modulo this prime: k + j * P all hash alike


def _float_text(n):
    return "0." + "0" * (n - 3) + "1"  # n characters, a valid float


@pytest.mark.parametrize("tag", ["f", "c_real", "c_imag"])
def test_a_number_text_of_exactly_the_bound_decodes_and_one_more_is_refused(tag):
    assert PLAIN_MAX_NUMBER_CHARS == 4400  # the documented bound (docs/rewards.md)
    for n, ok in ((PLAIN_MAX_NUMBER_CHARS - 1, True), (PLAIN_MAX_NUMBER_CHARS, True), (PLAIN_MAX_NUMBER_CHARS + 1, False)):
        text = _float_text(n)
        v = ["f", text] if tag == "f" else ["c", text, "1.0"] if tag == "c_real" else ["c", "1.0", text]
        if ok:
            plain_decode(v)
        else:
            with pytest.raises(PlainError, match=r"^bad number$"):
                plain_decode(v)


def test_a_number_that_is_not_text_is_refused():
    for v in (["i", 12], ["f", 0.5], ["c", "1", None]):
        with pytest.raises(PlainError, match=r"^bad number$"):
            plain_decode(v)


def _colliding(k, n):
    return [k + j * P for j in range(n)]


def _as_set(keys, tag="S"):
    return [tag, [plain_encode(x) for x in keys]]


def _as_dict(keys):
    return ["d", [[plain_encode(x), ["n"]] for x in keys]]


@pytest.mark.parametrize("build", [_as_set, lambda k: _as_set(k, "F"), _as_dict])
def test_same_hash_bound_counts_the_longest_run_exactly(build):
    assert PLAIN_MAX_SAME_HASH == 16
    others = list(range(100, 130))  # distinct hashes around the colliding ones
    for n in (PLAIN_MAX_SAME_HASH - 1, PLAIN_MAX_SAME_HASH):
        assert len(plain_decode(build(_colliding(7, n) + others))) == n + len(others)
        # two groups of n colliding keys each: the count starts again for each hash
        assert len(plain_decode(build(_colliding(7, n) + _colliding(9, n) + others))) == 2 * n + len(others)
    with pytest.raises(PlainError, match=r"^too many keys with one hash$"):
        plain_decode(build(_colliding(7, PLAIN_MAX_SAME_HASH + 1) + others))
    with pytest.raises(PlainError, match=r"^too many keys with one hash$"):
        plain_decode(build(_colliding(9, PLAIN_MAX_SAME_HASH) + _colliding(7, PLAIN_MAX_SAME_HASH + 1)))


def test_an_unhashable_member_among_many_is_refused_by_name():
    members = [plain_encode(i) for i in range(PLAIN_MAX_SAME_HASH + 1)] + [["l", []]]
    with pytest.raises(PlainError, match=r"^unhashable key$"):
        plain_decode(["S", members])
    with pytest.raises(PlainError):  # a few members: building the set itself refuses it
        plain_decode(["S", [["i", "1"], ["l", []]]])


# ---- the item bound through every container
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


# ---- properties (hypothesis)
# bounded: a few seconds per test; no example database written into the tree
SETTINGS = settings(max_examples=100, deadline=timedelta(seconds=2), database=None,
                    suppress_health_check=[HealthCheck.too_slow])


scalars = (st.none() | st.booleans() | st.integers() | st.integers(-10**400, 10**400)
           | st.floats(allow_nan=True, allow_infinity=True) | st.complex_numbers(allow_nan=False)
           | st.text(max_size=20) | st.binary(max_size=20))


hashables = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
                         | st.binary(max_size=8),
                         lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3), max_leaves=6)


values = st.recursive(scalars, lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                                              | st.sets(hashables, max_size=4) | st.frozensets(hashables, max_size=4)
                                              | st.dictionaries(hashables, inner, max_size=4)), max_leaves=16)


def same(a, b) -> bool:
    """Equal with exactly the same types all the way down (True is not 1, a tuple is not a list); NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return len(a) == len(b) and all(any(same(k, j) and same(v, b[j]) for j in b) for k, v in a.items())
    if type(a) in (set, frozenset):
        return len(a) == len(b) and all(any(same(x, y) for y in b) for x in a)
    return a == b


@SETTINGS
@given(values)
def test_encode_json_decode_gives_back_the_same_value_and_types(v):
    wire = json.loads(json.dumps(plain_encode(v)))
    assert same(plain_decode(wire), v)


json_like = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                         max_leaves=20)


tagged_junk = st.recursive(st.sampled_from([["n"], ["b", True], ["i", "7"], ["f", "0.5"], ["s", "x"], ["y", "00"]])
                           | json_like,
                           lambda inner: st.tuples(st.sampled_from(["l", "t", "S", "F", "d", "i", "f", "c", "y", "b", "q"]),
                                                   st.lists(inner, max_size=4)).map(list)
                           | st.lists(st.lists(inner, min_size=2, max_size=2), max_size=3).map(lambda kv: ["d", kv]),
                           max_leaves=20)


@SETTINGS
@given(tagged_junk)
def test_decoding_anything_gives_plain_data_or_plain_error(v):
    try:
        out = plain_decode(v)
    except PlainError:
        return
    assert same(plain_decode(json.loads(json.dumps(plain_encode(out)))), out)  # what it built is plain data


@SETTINGS
@given(st.integers(0, 3), st.sampled_from(["l", "t", "d"]))
def test_the_depth_bound_holds_both_ways(extra, kind):
    def nest(depth):
        v = 0
        for _ in range(depth):
            v = [v] if kind == "l" else (v,) if kind == "t" else {"k": v}
        return v

    ok = nest(PLAIN_MAX_DEPTH)
    assert plain_decode(plain_encode(ok)) == ok
    deep = nest(PLAIN_MAX_DEPTH + 1 + extra)
    with pytest.raises(PlainError):
        plain_encode(deep)
    tagged = ["i", "0"]
    for _ in range(PLAIN_MAX_DEPTH + 1 + extra):
        tagged = ["l", [tagged]]
    with pytest.raises(PlainError):
        plain_decode(tagged)


class Int(int):
    pass


@settings(SETTINGS, max_examples=50)
@given(values)
def test_a_subclass_anywhere_is_refused(v):
    for wrapped in ([v, Int(1)], {"k": (v, Int(2))}, (Int(3),)):
        with pytest.raises(PlainError):
            plain_encode(wrapped)
