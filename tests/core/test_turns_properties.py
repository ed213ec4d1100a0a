"""Property tests (hypothesis) of the turn-aligned response mask (ebpo.core.turns, ebpo.core.likelihood) against
plain loops, on random turn layouts: aligned ones (`layout_segments`) and raw concatenations that may leak."""
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ebpo.core.likelihood import turn_response_mask
from ebpo.core.turns import layout_segments, leaking_blocks, round_up, turn_index

# bounded: a few seconds per test; no example database written into the tree
SETTINGS = settings(max_examples=300, deadline=timedelta(seconds=2), database=None,
                    suppress_health_check=[HealthCheck.too_slow])
FILL = 1


@st.composite
def trajectories(draw):
    """Rows of time-ordered segments: a prompt (context), then model turns and environment answers in any
    order and length (a turn may follow a turn, an answer an answer), token ids irrelevant."""
    K = draw(st.integers(1, 6))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        segs = [([7] * draw(st.integers(0, 9)), False)]
        for _ in range(draw(st.integers(0, 5))):
            segs.append(([8] * draw(st.integers(1, 9)), draw(st.booleans())))
        rows.append(segs)
    return K, rows, draw(st.booleans())


def _raw(segs):
    gen, seg = [], []
    for s, (ids, g) in enumerate(segs):
        gen += [g] * len(ids)
        seg += [s] * len(ids)
    return gen, seg


def _pad(rows):
    """(B, L) generated and segment of rows of different lengths, right padding segment -1."""
    L = max(1, max(len(g) for g, _ in rows))
    gen = torch.zeros(len(rows), L, dtype=torch.bool)
    seg = torch.full((len(rows), L), -1, dtype=torch.long)
    for i, (g, s) in enumerate(rows):
        gen[i, :len(g)] = torch.tensor(g, dtype=torch.bool)
        seg[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return gen, seg


def _plain_leaks(gen, seg, K):
    """Blocks (row, block) in which some generated token shares its block with a token of a later segment."""
    out = set()
    for i in range(gen.shape[0]):
        g, s = gen[i].tolist(), seg[i].tolist()
        for b0 in range(0, len(g), K):
            idx = range(b0, min(b0 + K, len(g)))
            if any(g[p] and any(s[q] > s[p] for q in idx) for p in idx):
                out.add((i, b0 // K))
    return out


@SETTINGS
@given(trajectories())
def test_layout_then_mask_is_the_generated_tokens_and_never_leaks(t):
    K, rows, pad_last = t
    lays = [layout_segments(segs, K, FILL, pad_last=pad_last) for segs in rows]
    for segs, lay in zip(rows, lays):
        assert len(lay.ids) == len(lay.generated) == len(lay.segment) == len(lay.filler)
        assert [i for i, f in zip(lay.ids, lay.filler) if not f] == [x for ids, _ in segs for x in ids]
        # a model turn followed by anything (or the last, with pad_last) ends on a block boundary
        for s, (_, g) in enumerate(segs):
            ends = max((p for p, v in enumerate(lay.segment) if v == s), default=None)
            if g and ends is not None and (pad_last or s + 1 < len(segs)):
                assert (ends + 1) % K == 0
        assert sum(lay.filler) <= sum(K - 1 for _, g in segs if g)
    gen, seg = _pad([(lay.generated, lay.segment) for lay in lays])
    assert not _plain_leaks(gen, seg, K)
    assert torch.equal(turn_response_mask(gen, seg, K), gen)


@SETTINGS
@given(trajectories())
def test_raw_concatenations_leak_exactly_where_a_plain_loop_says(t):
    K, rows, _ = t
    gen, seg = _pad([_raw(segs) for segs in rows])
    leaks = _plain_leaks(gen, seg, K)
    got = leaking_blocks(gen, seg, K)
    assert got.shape == (gen.shape[0], round_up(gen.shape[1], K) // K)
    assert {tuple(x) for x in got.nonzero().tolist()} == leaks
    if leaks:
        row, blk = min(leaks)
        with pytest.raises(ValueError, match=f"row {row} block {blk}"):
            turn_response_mask(gen, seg, K)
    else:
        assert torch.equal(turn_response_mask(gen, seg, K), gen)


@SETTINGS
@given(trajectories())
def test_turn_index_numbers_the_generated_segments_in_order(t):
    K, rows, pad_last = t
    lays = [layout_segments(segs, K, FILL, pad_last=pad_last) for segs in rows]
    gen, seg = _pad([(lay.generated, lay.segment) for lay in lays])
    idx = turn_index(gen, seg)
    for i in range(gen.shape[0]):
        turn, last = -1, None
        for p in range(gen.shape[1]):
            if gen[i, p]:
                if seg[i, p] != last:
                    turn += 1
                last = int(seg[i, p])
                assert idx[i, p] == turn
            else:
                assert idx[i, p] == -1
