"""Property tests (hypothesis) of plain data (rewards/_plain.py): encode / JSON / decode round trips on random
nested values give back the same value with the same exact types; decoding any JSON-like input either gives a
plain value or raises PlainError (never another exception); the depth bound holds both ways."""
import json
import math
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards._plain import PLAIN_MAX_DEPTH, PlainError, plain_decode, plain_encode

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
