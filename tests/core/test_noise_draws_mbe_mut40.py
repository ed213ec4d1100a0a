"""Device and model-interface rules of ebpo/core/noise_draws.py and ebpo/core/mbe_objective.py that their mutation
runs (issue 40) left unpinned on a CPU-only machine, checked here without a GPU.

* `exact_elbo_masks` puts every output on its generator's device, whatever the default device is
  (`torch.set_default_device`, as GPU users set it): run under the `meta` default device, the only other device
  torch offers on a CPU-only machine, it returns the same CPU tensors as without it (a tensor that followed the
  default device instead would be on `meta`, or fail when mixed with the CPU ones);
* `mbe_window_mask(..., device=d)` builds the mask on `d` (checked with `meta`);
* `mbe_window_loss` reads the hidden states as the output's `last_hidden_state` when it has one, else as its first
  item (an output whose first item is something else, e.g. logits first, or a plain tuple); it calls the model
  with the window's positions 0..L-1 (the window shifts block boundaries, not positions) and `return_logits=False`
  (the LM head runs only on the selected positions: no (B, L, V) logits).

Not checkable on one device: the moves of `mbe_window_loss` onto `clean.device` (its substitution runs on the CPU,
so on a CPU-only machine the move is a no-op, and a `meta` `clean` has no values to substitute), and
`exact_elbo_masks` moving the input mask onto the generator's device (a `meta` input cannot be copied to the CPU).
"""
from collections import namedtuple

import pytest
import torch

from ebpo.core.mbe_objective import mbe_window_loss, mbe_window_mask
from ebpo.core.noise import substitution_ids
from ebpo.core.noise_draws import exact_elbo_masks
from ebpo.model import LLaDA2MoeModelLM, tiny_config


@pytest.mark.parametrize("seed", range(3))
def test_exact_elbo_masks_follow_the_generator_not_the_default_device(seed):
    g = torch.Generator().manual_seed(seed)
    B, L, K, N = 3, 11, 4, 5  # a partial last block
    resp = torch.rand(B, L, generator=g) < 0.6
    resp[0] = False  # a row without response tokens: its blocks take the t = 1 branch
    want = exact_elbo_masks(resp, K, N, torch.Generator().manual_seed(seed))
    with torch.device("meta"):
        got = exact_elbo_masks(resp, K, N, torch.Generator().manual_seed(seed))
    for w, x in zip(want, got):
        assert x.device.type == "cpu" and x.dtype == w.dtype and torch.equal(x, w)


def test_mbe_window_mask_is_built_on_the_device_asked():
    cpu = mbe_window_mask(10, 2, 1, 1, device="cpu")
    meta = mbe_window_mask(10, 2, 1, 1, device="meta")
    assert meta.device.type == "meta" and meta.shape == cpu.shape == (1, 1, 10, 10) and meta.dtype == cpu.dtype


class _Recorder(torch.nn.Module):
    """The tiny model behind another output form; records the positions and return_logits it was called with.
    form "tuple": (hidden,); "logits_first": (logits, last_hidden_state) with attribute names, its first item
    not the hidden states."""

    Out = namedtuple("Out", "logits last_hidden_state")

    def __init__(self, inner, form):
        super().__init__()
        self.inner, self.form, self.calls = inner, form, []

    def forward(self, input_ids, attention_mask, position_ids, return_logits):  # all four required
        self.calls.append((position_ids, return_logits))
        h = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       return_logits=False).last_hidden_state
        return (h,) if self.form == "tuple" else self.Out(logits=h.flip(-1) + 1.0, last_hidden_state=h)


def _mbe_case():
    """A tiny model, a batch of 2 x 10 (responses from position 3) and mbe_window_loss's keyword arguments."""
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=1, block_size=2)).eval()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.randint(8, 60, (2, 10), generator=torch.Generator().manual_seed(1))
    resp = torch.zeros(2, 10, dtype=torch.bool)
    resp[:, 3:] = True
    return model, clean, resp, dict(block_size=2, window=2, rate=0.5, keep_weight=0.5, allowed_ids=allowed)


@pytest.mark.parametrize("form", ["tuple", "logits_first"])
def test_mbe_window_loss_reads_the_hidden_states_of_either_output_form(form):
    model, clean, resp, kw = _mbe_case()
    with torch.no_grad():
        want, wm = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator().manual_seed(2), **kw)
        rec = _Recorder(model, form)
        got, gm = mbe_window_loss(rec, model.lm_head, clean, resp, generator=torch.Generator().manual_seed(2), **kw)
    assert wm["acc/mbe_restore"] == gm["acc/mbe_restore"] and wm["mbe/shift"] == gm["mbe/shift"]
    # the same forward and the same selections: equal up to fp32 summation order (losses of O(5))
    assert abs(float(want) - float(got)) < 1e-5 and abs(wm["loss/mbe_keep"] - gm["loss/mbe_keep"]) < 1e-5
    [(pos, return_logits)] = rec.calls
    assert torch.equal(pos, torch.arange(10)) and return_logits is False


def test_mbe_window_loss_builds_its_mask_and_positions_on_the_inputs_device():
    """The window mask and the position ids are made on `clean`'s device: under a `meta` default device, with the
    model, inputs and generator on the CPU, the loss and metrics are the same (a mask or positions made on the
    default device would be `meta` and fail the forward)."""
    model, clean, resp, kw = _mbe_case()
    with torch.no_grad():
        want, wm = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator().manual_seed(2), **kw)
        with torch.device("meta"):
            got, gm = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator().manual_seed(2),
                                      **kw)
    assert got.device.type == "cpu" and torch.equal(got, want) and gm == wm
