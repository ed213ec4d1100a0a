"""Edges of ebpo/core helpers found unpinned by the mutation run of issue 40: layout_segments' block size and
pad_last, the schedule's defaults, exact-ELBO masks for one draw, every remainder and blocks without response."""
import pytest
import torch

from ebpo.core.noise_draws import exact_elbo_masks
from ebpo.core.schedule import lr_schedule
from ebpo.core.turns import layout_segments


def test_layout_segments_refuses_a_block_size_below_one():
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


def test_schedule_defaults_are_cosine_to_zero():
    for p in (4, 5, 7, 9):
        assert lr_schedule(p, 1, 4, 10) == lr_schedule(p, 1, 4, 10, "cosine", 0.0)
    assert lr_schedule(7, 1, 4, 10) < 1.0 and lr_schedule(10, 1, 4, 10) == pytest.approx(0.0)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_exact_elbo_masks_shapes_for_every_remainder_and_one_draw(K):
    for L in range(K, 3 * K + 1):
        resp = torch.zeros(2, L, dtype=torch.bool)
        resp[:, 1:] = True
        resp[1, :] = False  # a row without response: t = 1, nothing masked
        for n in (1, 3):
            masked, t, w = exact_elbo_masks(resp, K, n, torch.Generator().manual_seed(L))
            assert masked.shape == (n, 2, L) and w.shape == (n, 2, L)
            assert t.shape == (n, 2, -(-L // K))
            assert not masked[:, 1].any() and (t[:, 1] == 1).all() and (w[:, 1] == 0).all()
            assert not (masked & ~resp).any()
    with pytest.raises(ValueError, match=r"^n_draws: must be >= 1, got 0$"):
        exact_elbo_masks(resp, K, 0, torch.Generator().manual_seed(0))
