"""LCS edit labels (ebpo.core.levenshtein) against brute force: exhaustive BFS over every label vector, enumerated
LCS lengths, and a plain-loop reading of the gap rules.

* property tests (hypothesis) against a brute-force aligner and a plain reading of the rules
  (tests/support/lev_reference.py), on random short blocks with masks;
* label rounds to a target and `ops_from_ids` (the inverse of `label_ids`, tokens included) against plain loops;
  `lcs_labels` refuses anything but two equal (n, k) blocks;
* every tensor the label functions make stays on their inputs' device: under a `meta` default device, with the
  inputs on the CPU, they return exactly what they return without one (a table, index or buffer made on the
  default device would be `meta` and fail where it meets the CPU inputs)."""
import collections
import itertools
import random
import re
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ebpo.core.levenshtein import (DEL, INS, KEEP, SUB, alignment, apply_labels, apply_ops, label_ids, lcs_labels,
                                   ops_from_ids, rounds_to_target)
from tests.support import lev_reference as ref

M = 0  # the mask id of these tests; tokens are 1..A


def _apply_plain(x, ops, toks, K):
    out = []
    for xi, op, t in zip(x, ops, toks):
        if op == KEEP:
            out.append(xi)
        elif op == SUB:
            out.append(t)
        elif op == INS:
            out += [M, xi]
    return tuple(out[:K] + [M] * (K - len(out)))


def _labels(x, y):
    ops, toks = lcs_labels(torch.tensor([x]), torch.tensor([y]), M)
    return ops[0].tolist(), toks[0].tolist()


def test_rules_on_hand_examples():
    # a dropped token: one INS on the anchor after the gap; the surplus trailing token is deleted
    assert _labels([1, 3, 4, 5], [1, 2, 3, 4])[0] == [KEEP, INS, KEEP, DEL]
    # a repeated token: delete the copy, the tail is padded with [MASK]
    ops, toks = _labels([1, 2, 2, 3], [1, 2, 3, 4])
    assert ops == [KEEP, KEEP, DEL, KEEP]
    assert apply_ops(torch.tensor([[1, 2, 2, 3]]), torch.tensor([ops]), torch.tensor([toks]), M).tolist() == [[1, 2, 3, M]]
    # masks match anything and are filled (SUB with the target token); no anchor at all: delete everything
    assert _labels([M, M, M, M], [1, 2, 3, 4]) == ([SUB] * 4, [1, 2, 3, 4])
    assert _labels([5, 6, 7, 8], [1, 2, 3, 4])[0] == [DEL] * 4
    # a gap with as many draft as target tokens: substitutions in order
    assert _labels([1, 4, 3, 2], [1, 2, 3, 2]) == ([KEEP, SUB, KEEP, KEEP], [1, 2, 3, 2])
    # two target tokens missing in one gap: only one insert this round
    assert _labels([1, 4, M, M], [1, 2, 3, 4])[0].count(INS) <= 1


def test_mask_only_noise_gives_identity_alignment():
    """The L-EBPO bit-for-bit property: a target with some positions masked aligns position for position."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(1, 5, (500, 8), generator=g)
    x = y.masked_fill(torch.rand(500, 8, generator=g) < 0.5, M)
    ops, toks = lcs_labels(x, y, M)
    assert torch.equal(toks, y)
    assert torch.equal(ops == SUB, x == M) and not ((ops == DEL) | (ops == INS)).any()


def _brute_lcs(x, y):
    K = len(x)
    for n in range(K, 0, -1):
        for a in itertools.combinations(range(K), n):
            for b in itertools.combinations(range(K), n):
                if all(x[i] == M or x[i] == y[j] for i, j in zip(a, b)):
                    return n
    return 0


def test_anchors_are_a_longest_common_subsequence():
    rng = random.Random(0)
    xs, ys = [], []
    for _ in range(1500):
        K = 5
        xs.append([rng.choice([M, 1, 2, 3]) for _ in range(K)])
        ys.append([rng.choice([1, 2, 3]) for _ in range(K)])
    anchor = alignment(torch.tensor(xs), torch.tensor(ys), M).tolist()
    for x, y, a in zip(xs, ys, anchor):
        pairs = [(i, j) for i, j in enumerate(a) if j >= 0]
        assert all(x[i] == M or x[i] == y[j] for i, j in pairs)
        assert all(j1 < j2 for (_, j1), (_, j2) in zip(pairs, pairs[1:]))
        assert len(pairs) == _brute_lcs(x, y), (x, y, a)


def test_labels_match_plain_loop_reading_of_the_rules():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(1, 4, (3000, 8), generator=g)
    x = torch.randint(0, 4, (3000, 8), generator=g)
    ops, toks = lcs_labels(x, y, M)
    anchor = alignment(x, y, M)
    for r in range(x.shape[0]):
        assert (ops[r].tolist(), toks[r].tolist()) == ref.labels(x[r].tolist(), y[r].tolist(), anchor[r].tolist(), M)
    # the block never overflows: a round deletes at least as many tokens as it inserts
    assert ((ops == DEL).sum(-1) >= (ops == INS).sum(-1)).all()


def test_label_rounds_reach_every_target_against_exhaustive_bfs_oracle():
    """Every (draft, target) pair of K=4 over 3 tokens (+ [MASK] in drafts): 20,736 pairs. The oracle searches
    all label vectors (keep / substitute by any token / delete / insert at each position: 6^4 per state) for the
    fewest rounds; the rule labels always reach the target, and in at most 2 rounds more than that optimum
    (the rules delete the tail after the last anchor instead of substituting it, and break LCS ties without
    looking ahead)."""
    A, K = (1, 2, 3), 4
    states = list(itertools.product((M,) + A, repeat=K))
    acts = [(KEEP, 0), (DEL, 0), (INS, 0)] + [(SUB, a) for a in A]
    labs = list(itertools.product(acts, repeat=K))
    pred = collections.defaultdict(set)
    for s in states:
        for lab in labs:
            pred[_apply_plain(s, [o for o, _ in lab], [t for _, t in lab], K)].add(s)
    targets = list(itertools.product(A, repeat=K))
    optimum = {}
    for y in targets:
        d, frontier = {y: 0}, [y]
        while frontier:
            nxt = []
            for n in frontier:
                for p in pred[n]:
                    if p not in d:
                        d[p] = d[n] + 1
                        nxt.append(p)
            frontier = nxt
        optimum[y] = d
    X = torch.tensor([s for s in states for _ in targets])
    Y = torch.tensor([y for _ in states for y in targets])
    rounds = rounds_to_target(X, Y, M, max_rounds=12)
    best = torch.tensor([optimum[y][s] for s in states for y in targets])
    assert (rounds <= 12).all(), "a rule trajectory never reached its target"
    extra = rounds - best
    assert extra.min() >= 0 and extra.max() <= 2
    assert float((extra == 0).float().mean()) > 0.25 and float((extra == 2).float().mean()) < 0.01


def test_random_length_errors_converge_quickly():
    """Targets with repeated / dropped / inserted tokens in K=8 blocks: the rounds reach the target."""
    rng = random.Random(2)
    xs, ys = [], []
    for _ in range(2000):
        y = [rng.randint(1, 6) for _ in range(8)]
        x = list(y)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(8)
            kind = rng.choice(["dup", "drop", "ins", "sub", "mask"])
            if kind == "dup":
                x.insert(i, x[i])
            elif kind == "drop":
                x.pop(i)
            elif kind == "ins":
                x.insert(i, rng.randint(1, 6))
            elif kind == "sub":
                x[i] = rng.randint(1, 6)
            else:
                x[i] = M
            x = (x + [M] * 8)[:8]
        xs.append(x)
        ys.append(y)
    rounds = rounds_to_target(torch.tensor(xs), torch.tensor(ys), M, max_rounds=10)
    assert (rounds <= 10).all()
    assert float(rounds.float().mean()) < 3.0


def test_label_ids_round_trip():
    g = torch.Generator().manual_seed(3)
    y = torch.randint(1, 4, (200, 8), generator=g)
    x = torch.randint(0, 4, (200, 8), generator=g)
    ops, toks = lcs_labels(x, y, M)
    ids = label_ids(ops, toks, 100, 101)
    ops2, toks2 = ops_from_ids(ids, x, 100, 101)
    sub_same = (ops == SUB) & (toks == x)  # a SUB that writes the token already there is a KEEP
    assert torch.equal(torch.where(sub_same, torch.full_like(ops, KEEP), ops), ops2)
    assert torch.equal(apply_ops(x, ops, toks, M), apply_ops(x, ops2, toks2, M))


DEL_ID, INS_ID = 90, 91


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


MASK = 9


def _blocks(seed: int, N: int = 40, K: int = 6):
    """Random short blocks over a 4-letter alphabet plus the mask, so matches, shifts and masks are common."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, 4, (N, K), generator=g)
    draft[torch.rand(N, K, generator=g) < 0.2] = MASK
    target = torch.randint(0, 4, (N, K), generator=g)
    return draft, target


def _all(draft, target):
    ops, toks = lcs_labels(draft, target, MASK)
    return (alignment(draft, target, MASK), ops, toks, apply_ops(draft, ops, toks, MASK),
            apply_labels(draft, target, MASK), rounds_to_target(draft, target, MASK, max_rounds=3))


def test_label_functions_give_the_same_under_a_meta_default_device():
    for seed in range(3):
        draft, target = _blocks(seed)
        want = _all(draft, target)
        with torch.device("meta"):
            got = _all(draft, target)
        for w, x in zip(want, got):
            assert x.device.type == "cpu" and x.dtype == w.dtype and torch.equal(x, w)
        assert (want[1] != 0).any() and (want[5] > 0).any()  # edits and multi-round blocks happen


MASK_ID = 0


def _plain_rounds(x, y, max_rounds):
    cur = torch.tensor([x])
    for r in range(max_rounds + 1):
        if cur[0].tolist() == y:
            return r
        ops, toks = lcs_labels(cur, torch.tensor([y]), MASK_ID)
        cur = apply_ops(cur, ops, toks, MASK_ID)
    return max_rounds + 1


def test_rounds_to_target_counts_label_rounds_like_a_plain_loop():
    rng = random.Random(5)
    xs, ys = [], []
    for _ in range(300):
        K = 5
        y = [rng.randint(1, 3) for _ in range(K)]
        x = list(y) if rng.random() < 0.2 else [rng.choice([MASK_ID, 1, 2, 3]) for _ in range(K)]
        xs.append(x)
        ys.append(y)
    for max_rounds in (0, 1, 2, 6):
        got = rounds_to_target(torch.tensor(xs), torch.tensor(ys), MASK_ID, max_rounds)
        assert got.dtype == torch.long
        assert got.tolist() == [_plain_rounds(x, y, max_rounds) for x, y in zip(xs, ys)], max_rounds
    assert {0, 1, 2, 7} <= set(rounds_to_target(torch.tensor(xs), torch.tensor(ys), MASK_ID, 6).tolist()) | {7}


def test_ops_from_ids_is_the_inverse_of_label_ids_tokens_included():
    g = torch.Generator().manual_seed(6)
    y = torch.randint(1, 4, (400, 6), generator=g)
    x = torch.randint(0, 4, (400, 6), generator=g)
    ops, toks = lcs_labels(x, y, MASK_ID)
    ops2, toks2 = ops_from_ids(label_ids(ops, toks, DEL_ID, INS_ID), x, DEL_ID, INS_ID)
    edit = (ops == DEL) | (ops == INS)
    assert edit.any() and torch.equal(ops2[edit], ops[edit])
    assert torch.equal(toks2[edit], x[edit])  # DELETE / INSERT carry the position's own token, as lcs_labels
    sub = ops == SUB
    assert torch.equal(toks2[sub], toks[sub]) and ((ops2[sub] == SUB) | (ops2[sub] == KEEP)).all()


LEV_MASK = 2  # the mask id of the L-EBPO tests


def test_lcs_labels_refuses_anything_but_two_equal_n_by_k_blocks():
    """lcs_labels takes draft and target of one shape (N, K): a different shape (both 2-D, or one row more) and
    a shape that is not 2-D are refused, naming both shapes."""
    bad = [((2, 4), (2, 5)), ((2, 4), (3, 4)), ((4,), (4,)), ((1, 2, 4), (1, 2, 4))]
    for ds, ts in bad:
        want = rf"^lcs_labels: draft and target must both be \(N, K\), got {re.escape(str(ds))} and {re.escape(str(ts))}$"
        with pytest.raises(ValueError, match=want):
            lcs_labels(torch.zeros(ds, dtype=torch.long), torch.zeros(ts, dtype=torch.long), LEV_MASK)
    ops, toks = lcs_labels(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), LEV_MASK)
    assert ops.shape == toks.shape == (2, 4)
