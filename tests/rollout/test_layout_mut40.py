"""`rollout.layout` against a plain per-row loop of its documented rule (issue 40's mutation run of
rollout/layout.py: the decode tests only read the valid query slots, so the padding, the slice length and the
last canvas position went unpinned)."""
import random

import pytest
import torch

from rollout.layout import build_layout, gather_span

MASK = 99


def _reference(canvas, q_start, q_end, bs, clamp_group, S):
    """The module docstring's rule, one row, one slot, one key at a time."""
    b, T = canvas.shape
    L = max(e - s for s, e in zip(q_start, q_end))
    ids, pos, valid, keep = [], [], [], []
    for r in range(b):
        qs, qe = q_start[r], q_end[r]
        cap = clamp_group[r] if clamp_group[r] is not None else T

        def grp(p, qs=qs, qe=qe, cap=cap):  # query slot group; -1 for padding
            return min(p // bs, cap) if p < qe else -1
        slots = [qs + i for i in range(L)]
        ids.append([int(canvas[r, p]) if p < qe else MASK for p in slots])
        pos.append(slots)
        valid.append([p < qe for p in slots])
        rows = []
        for i, p in enumerate(slots):
            g = grp(p)
            row = [j < qs and 0 <= j // bs <= g for j in range(S)]  # prefix keys before the slice
            row += [i2 == i or (grp(p2) >= 0 and grp(p2) <= g) for i2, p2 in enumerate(slots)]
            rows.append(row)
        keep.append([rows])
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(valid), torch.tensor(keep, dtype=torch.bool))


@pytest.mark.parametrize("seed", range(12))
def test_build_layout_matches_a_plain_loop(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    T = bs * rng.randint(2, 5)
    b = rng.randint(1, 4)
    canvas = torch.randint(0, 50, (b, T), generator=torch.Generator().manual_seed(seed))
    q_start, q_end, clamp = [], [], []
    for r in range(b):
        s = rng.randrange(T)
        e = T if r == 0 else rng.randint(s + 1, T)  # row 0 reaches the canvas's last position
        q_start.append(s)
        q_end.append(e)
        clamp.append(rng.choice([None, s // bs]))
    S = rng.choice([0, T])
    lay = build_layout(canvas, q_start, q_end, bs, clamp, S, MASK)
    ids, pos, valid, keep = _reference(canvas, q_start, q_end, bs, clamp, S)
    assert torch.equal(lay.input_ids, ids)
    assert torch.equal(lay.position_ids, pos)
    assert torch.equal(lay.valid, valid)
    assert lay.keep.shape == keep.shape and torch.equal(lay.keep, keep)


def test_gather_span_reads_each_rows_window_and_checks_the_row_count():
    h = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    out = gather_span(h, [1, 3], 2)
    assert torch.equal(out, torch.stack([h[0, 1:3], h[1, 3:5]]))
    with pytest.raises(ValueError, match="3 offsets for 2 rows"):
        gather_span(h, [0, 1, 2], 2)
