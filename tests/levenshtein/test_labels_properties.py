"""Property tests (hypothesis) of the LCS edit labels (ebpo.core.levenshtein) against a brute-force aligner and a
plain reading of the rules (tests/support/lev_reference.py), on random short blocks with masks."""
from datetime import timedelta

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import lev_reference as ref
from ebpo.core.levenshtein import DEL, INS, alignment, apply_ops, label_ids, lcs_labels

M, DEL_ID, INS_ID = 0, 90, 91
# bounded: a few seconds per test; no example database written into the tree
SETTINGS = settings(max_examples=300, deadline=timedelta(seconds=2), database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def blocks(draw, max_k=7):
    """A batch of (draft, target) blocks of one size K: tokens from a small alphabet (many repeats, so many
    ties), drafts with [MASK]s."""
    K = draw(st.integers(1, max_k))
    A = draw(st.integers(1, 4))
    n = draw(st.integers(1, 6))
    xs = draw(st.lists(st.lists(st.integers(0, A), min_size=K, max_size=K), min_size=n, max_size=n))
    ys = draw(st.lists(st.lists(st.integers(1, A), min_size=K, max_size=K), min_size=n, max_size=n))
    return xs, ys


@SETTINGS
@given(blocks(max_k=5))
def test_anchors_are_an_lcs_of_brute_force_length(b):
    xs, ys = b
    anchor = alignment(torch.tensor(xs), torch.tensor(ys), M).tolist()
    for x, y, a in zip(xs, ys, anchor):
        pairs = [(i, j) for i, j in enumerate(a) if j >= 0]
        assert all(x[i] == M or x[i] == y[j] for i, j in pairs)  # every anchor is a match
        assert all(j1 < j2 for (_, j1), (_, j2) in zip(pairs, pairs[1:]))  # in order
        assert len(pairs) == ref.brute_lcs(x, y, M)  # and as many as the longest common subsequence


@SETTINGS
@given(blocks())
def test_anchors_and_labels_equal_the_plain_reading_of_the_rules(b):
    xs, ys = b
    x, y = torch.tensor(xs), torch.tensor(ys)
    anchor = alignment(x, y, M).tolist()
    ops, toks = lcs_labels(x, y, M)
    ids = label_ids(ops, toks, DEL_ID, INS_ID).tolist()
    for r, (xr, yr) in enumerate(zip(xs, ys)):
        assert anchor[r] == ref.anchors(xr, yr, M)
        assert (ops[r].tolist(), toks[r].tolist()) == ref.labels(xr, yr, anchor[r], M)
        assert ids[r] == ref.label_ids(xr, yr, M, DEL_ID, INS_ID)


@SETTINGS
@given(blocks())
def test_a_label_round_never_overflows_and_keeps_the_block_length(b):
    xs, ys = b
    x = torch.tensor(xs)
    ops, toks = lcs_labels(x, torch.tensor(ys), M)
    assert ((ops == DEL).sum(-1) >= (ops == INS).sum(-1)).all()
    out = apply_ops(x, ops, toks, M)
    assert out.shape == x.shape
    for r in range(x.shape[0]):  # what the ops emit, in order, padded with [MASK]
        emitted = []
        for xi, o, t in zip(xs[r], ops[r].tolist(), toks[r].tolist()):
            emitted += [] if o == DEL else [M, xi] if o == INS else [t]
        assert len(emitted) <= x.shape[1]
        assert out[r].tolist() == emitted + [M] * (x.shape[1] - len(emitted))
