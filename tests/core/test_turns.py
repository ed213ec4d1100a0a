"""Turn layouts (ebpo.core.turns) and the turn-aligned response mask (with ebpo.core.likelihood) against plain loops.

* property tests (hypothesis) on random turn layouts: aligned ones (`layout_segments`) and raw concatenations
  that may leak;
* a block in which a model turn is followed by a later segment leaks, whatever follows that segment (the
  [turn t ; answer t ; turn t + 1] case included: its latest segment is generated again);
* `layout_segments` refuses a block size below one and pads a generated segment to a block boundary when another
  segment follows it, the last one too only with `pad_last`; TurnLayout's tensors have their documented dtypes,
  even empty."""
import itertools
import random
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ebpo.core.likelihood import turn_response_mask
from ebpo.core.turns import TurnLayout, layout_segments, leaking_blocks, round_up, turn_index


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


def _plain(gen, seg):
    return any(g and any(t > s for t in seg) for g, s in zip(gen, seg))


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_every_one_block_layout_leaks_exactly_when_a_generated_token_has_a_later_segment_beside_it(K):
    """All one-block rows of K tokens whose segments are non-decreasing (0..3, right padding -1) and every
    generated pattern: leaking iff some generated token shares the block with a later segment."""
    for segs in itertools.product(range(-1, 4), repeat=K):
        real = [s for s in segs if s >= 0]
        if real != sorted(real) or (-1 in segs and any(s >= 0 for s in segs[segs.index(-1):])):
            continue
        for gen in itertools.product([False, True], repeat=K):
            if any(g and s < 0 for g, s in zip(gen, segs)):
                continue
            g, s = torch.tensor([gen]), torch.tensor([segs])
            want = _plain(gen, segs)
            assert bool(leaking_blocks(g, s, K)[0, 0]) == want, (gen, segs)
            if want:
                with pytest.raises(ValueError, match="row 0 block 0"):
                    turn_response_mask(g, s, K)


def test_a_turn_an_answer_and_the_next_turn_in_one_block_is_refused():
    gen = torch.tensor([[True, False, True, True]])
    seg = torch.tensor([[1, 2, 3, 3]])
    assert leaking_blocks(gen, seg, 4).tolist() == [[True]]
    with pytest.raises(ValueError, match="later segment"):
        turn_response_mask(gen, seg, 4)


def test_layout_segments_refuses_block_sizes_0_and_minus_3():
    for k in (0, -3):
        with pytest.raises(ValueError, match=rf"^block_size must be positive, got {k}$"):
            layout_segments([([1], True)], k, 0)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_without_pad_last_only_the_last_generated_segment_stays_unpadded(K):
    segs = [([7] * 3, False), ([8] * 1, True), ([9] * 2, False), ([8] * 1, True)]
    lay = layout_segments(segs, K, 0, pad_last=False)
    assert lay.filler[-1] is False and lay.ids[-1] == 8  # the last turn: no filler after it
    first_turn_end = max(i for i, s in enumerate(lay.segment) if s == 1)
    assert (first_turn_end + 1) % K == 0  # a turn followed by something is padded to its block's end
    padded = layout_segments(segs, K, 0, pad_last=True)
    assert len(padded.ids) % K == 0 and len(padded.ids) >= len(lay.ids)


@pytest.mark.parametrize("bad", [0, -1, -4])
def test_layout_segments_refuses_a_block_size_below_one(bad):
    with pytest.raises(ValueError, match=f"^block_size must be positive, got {bad}$"):
        layout_segments([([1, 2], False), ([3], True)], bad, filler_id=0)


def _plain_layout(segments, K, filler, pad_last):
    """The docstring's rule as a loop: ids, generated, segment, filler lists."""
    ids, gen_out, seg_out, fill_out = [], [], [], []
    for s, (seg_ids, gen) in enumerate(segments):
        for t in seg_ids:
            ids.append(t), gen_out.append(bool(gen)), seg_out.append(s), fill_out.append(False)
        followed = s < len(segments) - 1
        if gen and (pad_last or followed):
            while len(ids) % K:
                ids.append(filler), gen_out.append(True), seg_out.append(s), fill_out.append(True)
    return ids, gen_out, seg_out, fill_out


@pytest.mark.parametrize("pad_last", [False, True])
def test_layout_segments_pads_the_last_generated_segment_only_with_pad_last(pad_last):
    """A generated segment is padded to a block boundary when another segment follows it, and the last one
    too only with `pad_last`; random layouts whose last segment is generated and ends off a boundary included."""
    rng = random.Random(11)
    last_unpadded = 0
    for _ in range(300):
        K = rng.randint(1, 5)
        segments = [([rng.randint(1, 50) for _ in range(rng.randint(0, 7))], rng.random() < 0.5)
                    for _ in range(rng.randint(1, 5))]
        out = layout_segments(segments, K, filler_id=0, pad_last=pad_last)
        assert (out.ids, out.generated, out.segment, out.filler) == _plain_layout(segments, K, 0, pad_last)
        ids, gen = segments[-1]
        last_unpadded += gen and len(out.ids) % K != 0
    assert (last_unpadded > 10) == (not pad_last)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_turn_layout_tensors_have_the_documented_dtypes_even_empty(n):
    ids, gen, seg = TurnLayout(list(range(n)), [True] * n, [1] * n).tensors()
    assert (ids.dtype, gen.dtype, seg.dtype) == (torch.long, torch.bool, torch.long)
    assert ids.tolist() == list(range(n)) and gen.tolist() == [True] * n and seg.tolist() == [1] * n
