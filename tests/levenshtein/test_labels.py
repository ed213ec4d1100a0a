"""LCS edit labels (ebpo.core.levenshtein) against brute force: exhaustive BFS over every label vector, enumerated
LCS lengths, and a plain-loop reading of the gap rules."""
import collections
import itertools
import random

import torch

from ebpo.core.levenshtein import (DEL, INS, KEEP, SUB, alignment, apply_ops, label_ids, lcs_labels, ops_from_ids,
                                   rounds_to_target)

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


def _plain_labels(x, y, anchor):
    """The gap rules read literally, one gap at a time (independent of the vectorised cummax bookkeeping)."""
    K = len(x)
    ops, toks = [None] * K, list(x)
    anchors = [(i, j) for i, j in enumerate(anchor) if j >= 0]
    pi, pj = -1, -1
    for i, j in anchors:
        free = list(range(pi + 1, i))
        tgt = list(range(pj + 1, j))
        for r, p in enumerate(free):
            if r < len(tgt):
                ops[p], toks[p] = SUB, y[tgt[r]]
            else:
                ops[p] = DEL
        if len(tgt) > len(free):
            ops[i] = INS
        elif x[i] == M:
            ops[i], toks[i] = SUB, y[j]
        else:
            ops[i] = KEEP
        pi, pj = i, j
    for p in range(pi + 1, K):
        ops[p] = DEL
    return ops, toks


def test_labels_match_plain_loop_reading_of_the_rules():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(1, 4, (3000, 8), generator=g)
    x = torch.randint(0, 4, (3000, 8), generator=g)
    ops, toks = lcs_labels(x, y, M)
    anchor = alignment(x, y, M)
    for r in range(x.shape[0]):
        assert (ops[r].tolist(), toks[r].tolist()) == _plain_labels(x[r].tolist(), y[r].tolist(), anchor[r].tolist())
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
