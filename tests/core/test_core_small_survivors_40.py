"""Rules of three small ebpo/core functions that no test pinned (issue 40's real survivors in core.md), each
against a plain computation of its docstring: lr_schedule's defaults, layout_segments' block-size check and
`pad_last`, and lev_stats' per-(draw, sequence) means."""
import math
import random
from types import SimpleNamespace

import pytest
import torch

from ebpo.core.lev_likelihood import lev_stats
from ebpo.core.likelihood import NoiseDraws
from ebpo.core.schedule import lr_schedule
from ebpo.core.turns import layout_segments


def test_lr_schedule_defaults_to_a_cosine_down_to_zero():
    """Without `schedule` and `min_ratio`: cosine from 1 at the end of warm-up to 0 at `total`, read at the
    step's start, and 0 after `total`."""
    warmup, total = 3, 13
    for progress in [3, 4, 5.5, 8, 12, 13, 20]:
        q = min(max((progress - warmup) / (total - warmup), 0.0), 1.0)
        want = 0.5 * (1 + math.cos(math.pi * q))
        assert lr_schedule(progress, 1.0, warmup, total) == pytest.approx(want, abs=1e-12), progress
    assert lr_schedule(13, 1.0, warmup, total) == pytest.approx(0.0, abs=1e-12)
    assert lr_schedule(1, 1.0, warmup, total) == pytest.approx(2 / 3)  # warm-up: the step's end over warmup


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


def test_lev_stats_are_means_per_draw_and_sequence():
    """DELETE labels, INSERT labels (among scored positions) and substituted (visible scored) positions, each
    summed over draws, sequences and positions and divided by draws x sequences."""
    N, B, L, DEL, INS = 3, 5, 8, 90, 91
    g = torch.Generator().manual_seed(4)
    masked = torch.rand(N, B, L, generator=g) < 0.4
    substituted = (torch.rand(N, B, L, generator=g) < 0.3) & ~masked
    targets = torch.randint(88, 92, (N, B, L), generator=g)  # DEL / INS also at unscored positions
    noise = NoiseDraws(masked, torch.ones(N, B, 2), torch.zeros(N, B, L), 4, substituted=substituted,
                       targets=targets)
    got = lev_stats(noise, SimpleNamespace(delete_token_id=DEL, insert_token_id=INS))
    dels = ins = vis = 0
    for n in range(N):
        for b in range(B):
            for i in range(L):
                scored = bool(masked[n, b, i] or substituted[n, b, i])
                dels += scored and int(targets[n, b, i]) == DEL
                ins += scored and int(targets[n, b, i]) == INS
                vis += bool(substituted[n, b, i])
    assert got == {"likelihood/lev_deletes_per_seq": pytest.approx(dels / (N * B)),
                   "likelihood/lev_inserts_per_seq": pytest.approx(ins / (N * B)),
                   "likelihood/lev_visible_scored_per_seq": pytest.approx(vis / (N * B))}
    assert dels and ins and vis
    assert lev_stats(NoiseDraws(masked, torch.ones(N, B, 2), torch.zeros(N, B, L), 4), None) == {}
