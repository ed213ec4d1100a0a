"""Plain data, the only thing that crosses between the judge and the candidate (shared source).

This file is not imported: its source is put in front of ``_harness.py`` (in the sandbox) and of
``_judge.py`` (the judge process), so both sides speak the same format. Standard library only, Python
>= 3.9. A value is tagged JSON: ``["n"]``, ``["b", true]``, ``["i", "12"]``, ``["f", "0.5"]``,
``["c", re, im]``, ``["s", "text"]``, ``["y", "hex"]``, ``["l"|"t"|"S"|"F", [items]]`` and
``["d", [[key, value], ...]]``. Encoding accepts exact builtin types only (an ``int`` subclass with a
lying ``__eq__`` is not an int). Decoding builds nothing but those builtins and bounds its own work:
nesting depth, number of items, length of each number's text, and how many set members or dict keys
share one hash (keys that all hash alike make building a set quadratic; string hashes are salted per
process, but ints, floats and tuples of them are not).
"""

PLAIN_MAX_DEPTH = 64
PLAIN_MAX_ITEMS = 1 << 18      # scalars and containers in one value
PLAIN_MAX_NUMBER_CHARS = 4400  # text of one int (Python's own default limit is 4300 digits)
PLAIN_MAX_SAME_HASH = 16       # set members / dict keys that share one hash value


class PlainError(ValueError):
    """A value that is not plain data, or that exceeds the limits."""


_ENCODE_TAGS = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_DECODE_TYPES = {"l": list, "t": tuple, "S": set, "F": frozenset}


def plain_encode(v, depth=0):
    """Tagged plain data for ``v``; raises PlainError on anything but exact builtin plain types."""
    if depth > PLAIN_MAX_DEPTH:
        raise PlainError("nested too deeply")
    t = type(v)
    if v is None:
        return ["n"]
    if t is bool:
        return ["b", v]
    if t is int:
        return ["i", str(v)]
    if t is float:
        return ["f", repr(v)]
    if t is complex:
        return ["c", repr(v.real), repr(v.imag)]
    if t is str:
        return ["s", v]
    if t is bytes:
        return ["y", v.hex()]
    if t in _ENCODE_TAGS:
        return [_ENCODE_TAGS[t], [plain_encode(x, depth + 1) for x in v]]
    if t is dict:
        return ["d", [[plain_encode(k, depth + 1), plain_encode(x, depth + 1)] for k, x in v.items()]]
    raise PlainError("not plain data: " + t.__name__)


def _number(text):
    if type(text) is not str or len(text) > PLAIN_MAX_NUMBER_CHARS:
        raise PlainError("bad number")
    return text


def _check_hashes(keys):
    """Refuse keys of which more than PLAIN_MAX_SAME_HASH share one hash (sorting the hashes is
    O(n log n); inserting n keys of one hash would be O(n^2))."""
    if len(keys) <= PLAIN_MAX_SAME_HASH:
        return
    try:
        hashes = sorted(hash(k) for k in keys)
    except TypeError:
        raise PlainError("unhashable key") from None
    run = 1
    for a, b in zip(hashes, hashes[1:]):
        run = run + 1 if a == b else 1
        if run > PLAIN_MAX_SAME_HASH:
            raise PlainError("too many keys with one hash")


class _Budget:
    def __init__(self):
        self.items = 0


def plain_decode(v, depth=0, budget=None):
    """Inverse of plain_encode; raises PlainError on anything malformed or over the limits."""
    budget = budget or _Budget()
    budget.items += 1
    if depth > PLAIN_MAX_DEPTH or budget.items > PLAIN_MAX_ITEMS:
        raise PlainError("value too deep or too large")
    if type(v) is not list or not v:
        raise PlainError("malformed value")
    tag, n = v[0], len(v)
    try:
        if tag == "n" and n == 1:
            return None
        if tag == "b" and n == 2 and type(v[1]) is bool:
            return v[1]
        if tag == "i" and n == 2:
            return int(_number(v[1]))
        if tag == "f" and n == 2:
            return float(_number(v[1]))
        if tag == "c" and n == 3:
            return complex(float(_number(v[1])), float(_number(v[2])))
        if tag == "s" and n == 2 and type(v[1]) is str:
            return v[1]
        if tag == "y" and n == 2 and type(v[1]) is str:
            return bytes.fromhex(v[1])
        if tag in _DECODE_TYPES and n == 2 and type(v[1]) is list:
            items = [plain_decode(x, depth + 1, budget) for x in v[1]]
            if tag in ("S", "F"):
                _check_hashes(items)
            return _DECODE_TYPES[tag](items)
        if tag == "d" and n == 2 and type(v[1]) is list:
            pairs = []
            for kv in v[1]:
                if type(kv) is not list or len(kv) != 2:
                    raise PlainError("malformed dict item")
                pairs.append((plain_decode(kv[0], depth + 1, budget), plain_decode(kv[1], depth + 1, budget)))
            _check_hashes([k for k, _ in pairs])
            return dict(pairs)
    except PlainError:
        raise
    except (ValueError, TypeError, OverflowError, MemoryError, RecursionError) as e:
        raise PlainError("bad value: " + type(e).__name__) from None
    raise PlainError("malformed value")
