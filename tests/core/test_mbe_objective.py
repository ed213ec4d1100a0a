"""The Multi-Block Editing window term (ebpo.core.mbe_objective) against a plain per-example computation with a
hand-built mask.

* every metric against a per-example reference, the shift's range (every s in 0..W occurs, nothing outside it),
  `keep_weight` scaling only the keep term, and a batch without substitutions (restore and its accuracy are 0,
  the keep term stays);
* `mbe_window_mask(..., device=d)` builds the mask on `d` (checked with `meta`);
* `mbe_window_loss` reads the hidden states as the output's `last_hidden_state` when it has one, else as its first
  item (an output whose first item is something else, e.g. logits first, or a plain tuple); it calls the model
  with the window's positions 0..L-1 (the window shifts block boundaries, not positions) and `return_logits=False`
  (the LM head runs only on the selected positions: no (B, L, V) logits).

Not checkable on one device: the moves of `mbe_window_loss` onto `clean.device` (its substitution runs on the CPU,
so on a CPU-only machine the move is a no-op, and a `meta` `clean` has no values to substitute)."""
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F

from ebpo.core.mbe_objective import mbe_window_loss, mbe_window_mask
from ebpo.core.noise import substitution_ids, t2t_substitute
from ebpo.model import LLaDA2MoeModelLM, tiny_config


def plain_keep(L, K, W, shift):
    """keep[i][j]: j's enlarged block (of (W+1)K tokens, boundaries shifted by `shift` K-blocks) <= i's."""
    blk = [(p + shift * K) // ((W + 1) * K) for p in range(L)]
    return torch.tensor([[blk[j] <= blk[i] for j in range(L)] for i in range(L)])


def test_window_mask_is_enlarged_block_causal_at_every_shift():
    for W in (1, 2):
        for shift in range(W + 1):
            assert torch.equal(mbe_window_mask(12, 2, W, shift)[0, 0], plain_keep(12, 2, W, shift)), (W, shift)
    # W = 1, K = 2, shift 0: position 0 sees the next block (positions 2, 3) but not position 4
    m = mbe_window_mask(8, 2, 1, 0)[0, 0]
    assert m[0, 3] and not m[0, 4] and m[4, 0]


def test_mbe_loss_equals_a_plain_computation():
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, block_size=2)).eval()
    clean = torch.randint(8, 60, (3, 10))
    resp = torch.zeros(3, 10, dtype=torch.bool)
    resp[:, 3:] = True
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    loss, m = mbe_window_loss(model, model.lm_head, clean, resp, block_size=2, window=1, rate=0.4, keep_weight=0.5,
                              allowed_ids=allowed, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # the same draws, in the same order
    shift = int(torch.randint(0, 2, (1,), generator=g))
    noisy, sub = t2t_substitute(clean, resp, 0.4, allowed, g)
    assert m["mbe/shift"] == shift and sub.any()
    keep = plain_keep(10, 2, 1, shift)
    restore, kept = [], []
    for i in range(3):
        logits = model(noisy[i:i + 1], attention_mask=keep[None, None], position_ids=torch.arange(10)).logits[0]
        ce = F.cross_entropy(logits.float(), clean[i], reduction="none")
        restore += ce[sub[i]].tolist()
        kept += ce[resp[i] & ~sub[i]].tolist()
    want = sum(restore) / len(restore) + 0.5 * sum(kept) / len(kept)
    assert abs(float(loss) - want) < 1e-4, (float(loss), want)


def test_mbe_loss_draws_its_shift_on_the_generators_device_whatever_the_default_device():
    """The shift is drawn with the caller's generator on that generator's device: a run whose default device is
    another one (here `meta`, which has no generator at all) gives the same loss as one on the CPU default."""
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, block_size=2)).eval()
    clean = torch.randint(8, 60, (2, 8))
    resp = torch.zeros(2, 8, dtype=torch.bool)
    resp[:, 2:] = True
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    kw = dict(block_size=2, window=1, rate=0.4, keep_weight=0.5, allowed_ids=allowed)
    want, m_want = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator().manual_seed(3), **kw)
    with torch.device("meta"):
        got, m_got = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator("cpu").manual_seed(3),
                                     **kw)
    assert got.device.type == "cpu" and m_got["mbe/shift"] == m_want["mbe/shift"]
    assert float(got) == float(want)


def _model():
    torch.manual_seed(0)
    return LLaDA2MoeModelLM(tiny_config(num_hidden_layers=1, block_size=2)).eval()


def _reference(model, clean, resp, K, W, rate, allowed, seed):
    """(restore mean CE, keep mean CE, restore accuracy, shift) drawn as the docstring says, one row at a time."""
    g = torch.Generator().manual_seed(seed)
    shift = int(torch.randint(0, W + 1, (1,), generator=g))
    noisy, sub = t2t_substitute(clean, resp, rate, allowed, g)
    L = clean.shape[1]
    blk = [(p + shift * K) // ((W + 1) * K) for p in range(L)]
    keep = torch.tensor([[blk[j] <= blk[i] for j in range(L)] for i in range(L)])
    restore, kept, hit = [], [], []
    for i in range(clean.shape[0]):
        logits = model(noisy[i:i + 1], attention_mask=keep[None, None], position_ids=torch.arange(L)).logits[0]
        ce = F.cross_entropy(logits.float(), clean[i], reduction="none")
        restore += ce[sub[i]].tolist()
        kept += ce[resp[i] & ~sub[i]].tolist()
        hit += (logits.argmax(-1) == clean[i])[sub[i]].tolist()
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return mean(restore), mean(kept), mean([float(h) for h in hit]), shift


def test_mbe_metrics_shift_and_keep_weight_match_the_reference():
    model = _model()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.randint(8, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    resp = torch.zeros(2, 12, dtype=torch.bool)
    resp[:, 2:] = True
    W, shifts = 2, set()
    for seed in range(4):  # seeds 0..3 draw the shifts 2, 1, 0, 1
        kw = 0.5 * (seed % 2)
        loss, m = mbe_window_loss(model, model.lm_head, clean, resp, block_size=2, window=W, rate=0.5,
                                  keep_weight=kw, allowed_ids=allowed, generator=torch.Generator().manual_seed(seed))
        r, k, acc, shift = _reference(model, clean, resp, 2, W, 0.5, allowed, seed)
        # fp32 CE of a 1-layer model over < 24 tokens: sums of O(10) terms, a few fp32 ulps of O(5)
        assert abs(m["loss/mbe_restore"] - r) < 1e-4 and abs(m["loss/mbe_keep"] - k) < 1e-4, seed
        assert abs(m["acc/mbe_restore"] - acc) < 1e-6 and m["mbe/shift"] == shift, seed
        assert abs(float(loss) - (r + kw * k)) < 1e-4, (seed, kw)
        shifts.add(shift)
    assert shifts == set(range(W + 1))  # every shift of 0..W drawn by these fixed seeds


def test_without_substitutions_only_the_keep_term_counts():
    model = _model()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.randint(8, 60, (2, 8), generator=torch.Generator().manual_seed(4))
    resp = torch.zeros(2, 8, dtype=torch.bool)
    resp[:, 3:] = True
    loss, m = mbe_window_loss(model, model.lm_head, clean, resp, block_size=2, window=1, rate=0.0, keep_weight=0.25,
                              allowed_ids=allowed, generator=torch.Generator().manual_seed(0))
    r, k, acc, _ = _reference(model, clean, resp, 2, 1, 0.0, allowed, 0)
    assert r == 0.0 and m["loss/mbe_restore"] == 0.0 and m["acc/mbe_restore"] == 0.0
    assert abs(m["loss/mbe_keep"] - k) < 1e-4 and abs(float(loss) - 0.25 * k) < 1e-4
    loss.backward()  # the empty restore term keeps the graph alive


def test_restore_accuracy_counts_the_head_s_hits():
    """acc/mbe_restore is the fraction of substituted positions where the head's argmax is the clean token: a
    head that always prefers the (single) clean token scores 1, one that prefers another token 0."""
    model = _model()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.full((2, 8), 9)
    resp = torch.zeros(2, 8, dtype=torch.bool)
    resp[:, 2:] = True
    for tok, want in [(9, 1.0), (10, 0.0)]:
        bias = torch.zeros(model.config.vocab_size)
        bias[tok] = 50.0
        _, m = mbe_window_loss(model, lambda h, b=bias: model.lm_head(h) + b, clean, resp, block_size=2, window=1,
                               rate=0.5, keep_weight=0.5, allowed_ids=allowed, generator=torch.Generator().manual_seed(1))
        assert m["acc/mbe_restore"] == want, tok


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
