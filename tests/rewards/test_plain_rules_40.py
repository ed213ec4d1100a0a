"""The plain-data limits at their exact boundaries (issue 40, from the mutation survivors of rewards/_plain.py):
the text of one number, and how many set members or dict keys may share one hash."""
import pytest

from rewards._plain import PLAIN_MAX_NUMBER_CHARS, PLAIN_MAX_SAME_HASH, PlainError, plain_decode, plain_encode

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
