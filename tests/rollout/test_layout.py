"""`rollout.layout` against a plain per-row loop of its documented rule (the decode tests only read the valid
query slots, so the padding, the slice length and the last canvas position need these), and its device rule.

Device rule: every tensor of a `Layout` (and `gather_span`'s output) is on the device of its input (the canvas, the
hidden states), whatever torch's default device is. GPU users set a default device
(`torch.set_default_device("cuda")`) or pass CUDA canvases with the default left on the CPU; a tensor built from the
per-row lists without `device=` then lands on the wrong device and the forward fails or mixes devices. On a CPU-only
machine the `meta` device stands in for "the other device": the functions run under `with torch.device("meta")` on
CPU inputs, so any tensor that followed the default device instead of the input's is on `meta` (it has no values:
reading it, or mixing it with the CPU tensors, fails), while the correct code returns the same CPU tensors as without
the context.
"""
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



def _case(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    T = bs * rng.randint(2, 5)
    b = rng.randint(2, 4)
    canvas = torch.randint(0, 50, (b, T), generator=torch.Generator().manual_seed(seed))
    q_start = [rng.randrange(T) for _ in range(b)]
    q_end = [T if r == 0 else rng.randint(s + 1, T) for r, s in enumerate(q_start)]
    clamp = [rng.choice([None, s // bs]) for s in q_start]
    return canvas, q_start, q_end, bs, clamp, rng.choice([0, T])


@pytest.mark.parametrize("seed", range(6))
def test_build_layout_stays_on_the_canvas_device_whatever_the_default_device(seed):
    canvas, q_start, q_end, bs, clamp, S = _case(seed)
    want = build_layout(canvas, q_start, q_end, bs, clamp, S, MASK)
    with torch.device("meta"):
        got = build_layout(canvas, q_start, q_end, bs, clamp, S, MASK)
    for name in ("input_ids", "position_ids", "keep", "valid"):
        w, g = getattr(want, name), getattr(got, name)
        assert g.device == canvas.device and g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("seed", range(4))
def test_gather_span_stays_on_the_hidden_states_device_whatever_the_default_device(seed):
    g = torch.Generator().manual_seed(seed)
    b, L, H, length = 3, 7, 5, 3
    hidden = torch.randn(b, L, H, generator=g)
    offsets = [int(v) for v in torch.randint(0, L - length + 1, (b,), generator=g)]
    want = torch.stack([hidden[i, o:o + length] for i, o in enumerate(offsets)])  # the plain slice per row
    with torch.device("meta"):
        got = gather_span(hidden, offsets, length)
    assert got.device == hidden.device and torch.equal(got, want)
