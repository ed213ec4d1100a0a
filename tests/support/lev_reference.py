"""A plain-Python reading of the LCS edit labels of ebpo/core/levenshtein.py (its module docstring), for tests.

`lcs_table` is the textbook suffix-LCS recursion (a [MASK] in the draft matches any target token);
`anchors` walks it left to right with the docstring's tie-breaking, one rule per line; `labels` applies the gap
rules one gap at a time. Nothing here is vectorised or shares code with the module under test.
"""
from __future__ import annotations

KEEP, SUB, DEL, INS = 0, 1, 2, 3


def lcs_table(x: list[int], y: list[int], mask: int) -> list[list[int]]:
    """D[i][j] = length of an LCS of x[i:] and y[j:] (x[i] == mask matches anything)."""
    n, m = len(x), len(y)
    D = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best = max(D[i + 1][j], D[i][j + 1])
            if x[i] == mask or x[i] == y[j]:
                best = max(best, D[i + 1][j + 1] + 1)
            D[i][j] = best
    return D


def brute_lcs(x: list[int], y: list[int], mask: int) -> int:
    """The LCS length by enumerating every pair of index subsets (tiny blocks only)."""
    import itertools

    for n in range(min(len(x), len(y)), 0, -1):
        for a in itertools.combinations(range(len(x)), n):
            for b in itertools.combinations(range(len(y)), n):
                if all(x[i] == mask or x[i] == y[j] for i, j in zip(a, b)):
                    return n
    return 0


def anchors(x: list[int], y: list[int], mask: int) -> list[int]:
    """For each draft position the matched target index or -1, walking an optimal alignment left to right:
    match as soon as matching is optimal, except that a [MASK] whose target index lies before its own position
    skips that target when skipping stays optimal; when only skips are optimal, take the one that brings the
    target index nearer the draft index (the draft skip on a tie)."""
    K = len(x)
    D = lcs_table(x, y, mask)
    out = [-1] * K
    i = j = 0
    while i < K and j < len(y):
        here = D[i][j]
        can_match = (x[i] == mask or x[i] == y[j]) and here == D[i + 1][j + 1] + 1
        skip_draft_ok, skip_target_ok = D[i + 1][j] == here, D[i][j + 1] == here
        if can_match and not (x[i] == mask and j < i and skip_target_ok):
            out[i] = j
            i, j = i + 1, j + 1
        elif skip_target_ok and (not skip_draft_ok or j < i):
            j += 1
        else:
            i += 1
    return out


def labels(x: list[int], y: list[int], anchor: list[int], mask: int) -> tuple[list[int], list[int]]:
    """(ops, toks) by the gap rules: paired gap positions SUB (target token), surplus DEL, one INS on the anchor
    after a gap with more target tokens; an anchor KEEP (SUB with its token if it is a [MASK]); DEL after the
    last anchor."""
    K = len(x)
    ops, toks = [None] * K, list(x)
    pi, pj = -1, -1
    for i, j in [(i, j) for i, j in enumerate(anchor) if j >= 0]:
        free, tgt = list(range(pi + 1, i)), list(range(pj + 1, j))
        for r, p in enumerate(free):
            if r < len(tgt):
                ops[p], toks[p] = SUB, y[tgt[r]]
            else:
                ops[p] = DEL
        if len(tgt) > len(free):
            ops[i] = INS
        elif x[i] == mask:
            ops[i], toks[i] = SUB, y[j]
        else:
            ops[i] = KEEP
        pi, pj = i, j
    for p in range(pi + 1, K):
        ops[p] = DEL
    return ops, toks


def label_ids(x: list[int], y: list[int], mask: int, delete_id: int, insert_id: int) -> list[int]:
    """The id each position is trained to predict: x_i (KEEP), the target token (SUB), DELETE or INSERT."""
    ops, toks = labels(x, y, anchors(x, y, mask), mask)
    return [delete_id if o == DEL else insert_id if o == INS else t for o, t in zip(ops, toks)]
