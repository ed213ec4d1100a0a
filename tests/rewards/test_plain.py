"""The plain-data format between judge and candidate: exact builtin types only, and decoding whose work
is bounded whatever the bytes say (depth, items, number text, keys that share one hash)."""
import json
import time

import pytest

from rewards._plain import PLAIN_MAX_SAME_HASH, PlainError, plain_decode, plain_encode

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
