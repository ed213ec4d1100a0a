"""Device rule of rollout/layout.py: every tensor of a `Layout` (and `gather_span`'s output) is on the device of
its input (the canvas, the hidden states), whatever torch's default device is.

GPU users set a default device (`torch.set_default_device("cuda")`) or pass CUDA canvases with the default left on
the CPU; a tensor built from the per-row lists without `device=` then lands on the wrong device and the forward
fails or mixes devices. On a CPU-only machine the `meta` device stands in for "the other device": the functions run
under `with torch.device("meta")` on CPU inputs, so any tensor that followed the default device instead of the
input's is on `meta` (it has no values: reading it, or mixing it with the CPU tensors, fails), while the correct
code returns the same CPU tensors as without the context. (issue 40: the mutation run's device survivors.)
"""
import random

import pytest
import torch

from rollout.layout import build_layout, gather_span

MASK = 99


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
