"""Device, dtype and model-interface rules of ebpo/core/likelihood.py, checked on a CPU-only machine.

* Every tensor the functions build follows their inputs' device, never torch's default device (GPU users set
  `torch.set_default_device("cuda")`, or leave the default on the CPU with CUDA inputs). On a CPU-only machine the
  `meta` device stands in for "the other device": the functions run under `with torch.device("meta")` on CPU
  inputs, so a tensor built without the input's device lands on `meta` (no values: mixing it with the CPU tensors
  or reading it fails) while the correct code returns the same CPU tensors as without the context. This holds for
  `response_mask_from_ids` (input_ids' device), `draw_noise` (the generator's), the composites of every layout
  (input_ids'), and `_noisy_inputs` moves draws kept on another device (the CPU) onto input_ids' device (`meta`
  input_ids: outputs on `meta`); `response_mask_from_ids` likewise moves prompt_lens / seq_lens.
* The composites are fp32 whatever the default dtype (a float64 default makes untyped `torch.zeros` float64).
* The noisy copy has input_ids' dtype (int32 ids give int32 noisy ids, substitutes and L-EBPO inputs included).
* The LM head is read through `get_output_embeddings()`: a head with a weight and no `bias` attribute at all (an
  `nn.Embedding` tied as the output head) is a head without bias, with or without the fused kernel.
* `use_module_head=True` reaches the head module from every entry point, and the default (False) reads the weight
  in fp32: with bf16 head weights the two differ by bf16 rounding, so a flag lost on the way shows.
* The model is called with `return_logits=False` (the head runs only on the gathered positions, never (B, L, V)
  logits), and `unwrap_hidden` reads an output's `last_hidden_state` when it has one, else its first item.

Not checkable on one device: `draw_noise` moving the response mask onto the generator's device (a `meta` mask
cannot be copied to the CPU generator's device, and there is no `meta` generator).
"""
import copy
from collections import namedtuple

import pytest
import torch

import ebpo.core.likelihood as lik
from ebpo.core.likelihood import (NoiseDraws, all_composites, composite_logprobs, composite_logprobs_blockwise,
                                  composite_logprobs_cached, direct_backward, draw_noise, gathered_logprobs,
                                  replay_backward, response_mask_from_ids, unwrap_hidden)

K, MASK = 4, 2


def _batch(seed=0, B=2, L=10):
    """Right-padded rows with a partial last block, prompts of 3 and 6 tokens."""
    ids = torch.randint(3, 100, (B, L), generator=torch.Generator().manual_seed(seed))
    resp = torch.zeros(B, L, dtype=torch.bool)
    resp[0, 3:], resp[1, 6:] = True, True
    return ids, resp


def _t2t(noise, resp, seed=1):
    """The draws with T2T substitutions at some visible response positions (weight 0.5 there)."""
    g = torch.Generator().manual_seed(seed)
    sub = (torch.rand(noise.masked.shape, generator=g) < 0.4) & ~noise.masked & resp[None]
    sub_ids = torch.randint(3, 100, noise.masked.shape, generator=g)
    return NoiseDraws(noise.masked, noise.t, torch.where(sub, 0.5, noise.weight), noise.block_size,
                      substituted=sub, sub_ids=sub_ids)


def _lev(noise, seed=2):
    """L-EBPO-style draws: a whole noisy input and the scored action per position."""
    g = torch.Generator().manual_seed(seed)
    return NoiseDraws(noise.masked, noise.t, noise.weight, noise.block_size,
                      noisy_ids=torch.randint(3, 100, noise.masked.shape, generator=g),
                      targets=torch.randint(3, 100, noise.masked.shape, generator=g))


# ------------------------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------------------------

def test_response_mask_follows_input_ids_not_the_default_device():
    ids, _ = _batch()
    ids[0, 5] = ids[1, 2] = 1  # EOS in a response and inside a prompt
    prompt_lens, seq_lens = torch.tensor([3, 6]), torch.tensor([9, 10])
    for sl in (None, seq_lens):
        want = response_mask_from_ids(ids, prompt_lens, 1, seq_lens=sl)
        with torch.device("meta"):
            got = response_mask_from_ids(ids, prompt_lens, 1, seq_lens=sl)
        assert got.device.type == "cpu" and torch.equal(got, want)
        # input_ids on another device than the lengths: the lengths are moved to input_ids' device
        got = response_mask_from_ids(ids.to("meta"), prompt_lens, 1, seq_lens=sl)
        assert got.device.type == "meta" and got.shape == want.shape and got.dtype == torch.bool


@pytest.mark.parametrize("seed", range(3))
def test_draw_noise_follows_the_generator_not_the_default_device(seed):
    _, resp = _batch()
    want = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(seed))
    with torch.device("meta"):
        got = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(seed))
    for f in ("masked", "t", "weight"):
        w, x = getattr(want, f), getattr(got, f)
        assert x.device.type == "cpu" and x.dtype == w.dtype and torch.equal(x, w), f


@pytest.mark.parametrize("form", ["mask", "t2t", "lev"])
def test_noisy_inputs_move_the_draws_to_input_ids_device(form):
    """Draws kept on the CPU, input_ids on another device (`meta`): every output on input_ids' device."""
    ids, resp = _batch()
    noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(0))
    noise = {"mask": noise, "t2t": _t2t(noise, resp), "lev": _lev(noise)}[form]
    noisy, scored, weight, targets = lik._noisy_inputs(noise, [2, 0], ids.to("meta"), MASK)
    outs = [noisy, scored, weight] + ([targets] if form == "lev" else [])
    assert targets is None or form == "lev"
    for x in outs:
        assert x.device.type == "meta" and x.shape == (2, 2, 10)


PATHS = ["unpacked", "packed", "cached", "cached_full", "blockwise"]


def _composites(model, ids, noise, path):
    if path == "blockwise":
        return torch.stack([composite_logprobs_blockwise(model, ids, noise, d, MASK) for d in range(3)], 1)
    if path.startswith("cached"):
        return composite_logprobs_cached(model, ids, noise, [0, 1, 2], MASK, return_blocks=True,
                                         by_block=path == "cached")
    return composite_logprobs(model, ids, noise, [0, 1, 2], MASK, packed=path == "packed", return_blocks=True)


@pytest.mark.parametrize("form", ["mask", "t2t"])
@pytest.mark.parametrize("path", PATHS)
def test_composites_follow_input_ids_not_the_default_device(small_model, path, form):
    ids, resp = _batch()
    noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(0))
    noise = noise if form == "mask" else _t2t(noise, resp)
    with torch.no_grad():
        want = _composites(small_model, ids, noise, path)
        with torch.device("meta"):
            got = _composites(small_model, ids, noise, path)
    for w, x in zip(*((want, got) if isinstance(want, tuple) else ((want,), (got,)))):
        assert x.device.type == "cpu" and x.dtype == torch.float32 and torch.equal(x, w)


# ------------------------------------------------------------------------------------------------------------
# Dtypes
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture
def restore_default_dtype():
    old = torch.get_default_dtype()
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("path", PATHS)
def test_composites_are_fp32_under_a_float64_default_dtype(small_model, path, restore_default_dtype):
    """The model's weights are fp32 (made before the fixture); its hidden states stay fp32 and the head runs in
    fp32, so the composites are the fp32 values of the default dtype: the same operations, equal bit for bit.
    (composite_logprobs_blockwise's accumulator once followed the default dtype and failed here.)"""
    ids, resp = _batch()
    noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _composites(small_model, ids, noise, path)
        torch.set_default_dtype(torch.float64)
        got = _composites(small_model, ids, noise, path)
    for w, x in zip(want, got):
        assert x.dtype == torch.float32 and torch.equal(x, w)


@pytest.mark.parametrize("form", ["t2t", "lev"])
def test_noisy_ids_keep_input_ids_dtype(form):
    """int32 token ids (as numpy-based tokenizers give them): the noisy copy is int32 too, with the values of the
    int64 computation (substitutes and L-EBPO inputs are stored int64)."""
    ids, resp = _batch()
    noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(0))
    noise = _t2t(noise, resp) if form == "t2t" else _lev(noise)
    want = lik._noisy_inputs(noise, [0, 1, 2], ids, MASK)[0]
    got = lik._noisy_inputs(noise, [0, 1, 2], ids.to(torch.int32), MASK)[0]
    assert want.dtype == torch.int64 and got.dtype == torch.int32 and torch.equal(got.long(), want)


# ------------------------------------------------------------------------------------------------------------
# The LM head and the model's interface
# ------------------------------------------------------------------------------------------------------------

class _TiedHead(torch.nn.Module):
    """A model whose output head is an nn.Embedding (weight (V, H), no `bias` attribute at all)."""

    def __init__(self, H=16, V=40):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.head = torch.nn.Embedding(V, H)

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("kernel", [True, False])
def test_a_head_without_a_bias_attribute_is_a_head_without_bias(monkeypatch, kernel):
    """float64 log-softmax reference; fp32 logits of H = 16 unit terms and a log-softmax over V = 40: errors of a
    few 1e-6, 1e-4 is well above them."""
    if not kernel:
        monkeypatch.setattr(lik, "_kernel_token_logprobs", lambda: None)
    model = _TiedHead()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 16, generator=g)
    targets = torch.randint(0, 40, (23,), generator=g)
    got = gathered_logprobs(model, hidden, targets)
    want = (hidden.double() @ model.head.weight.double().t()).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def bf16_head_model(small_model):
    """small_model with its LM head in bf16 (the body fp32): the module head computes bf16 logits, the default
    path the fp32 log-softmax of the same (bf16-valued) weight. The head is scaled by 4 (logits of ~10) so that
    bf16's rounding of them stands well above fp32's."""
    m = copy.deepcopy(small_model)
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    m.lm_head.to(torch.bfloat16)
    return m


def _entry_points(model, ids, noise, use_module_head):
    """Composites (B, N) of every entry point, with the flag passed (True) or left at its default (None)."""
    kw = {} if use_module_head is None else {"use_module_head": use_module_head}
    out = {}
    with torch.no_grad():
        out["composite"] = composite_logprobs(model, ids, noise, [0, 1, 2], MASK, **kw)
        out["composite_blocks"] = composite_logprobs(model, ids, noise, [0, 1, 2], MASK, return_blocks=True,
                                                     **kw)[1].sum(-1)
        out["composite_packed"] = composite_logprobs(model, ids, noise, [0, 1, 2], MASK, packed=True, **kw)
        for chunk in (0, 1):
            out[f"all_{chunk}"] = all_composites(model, ids, noise, MASK, chunk=chunk, **kw)
            out[f"all_{chunk}_blocks"] = all_composites(model, ids, noise, MASK, chunk=chunk, return_blocks=True,
                                                        **kw)[1].sum(-1)
        out["all_cached"] = all_composites(model, ids, noise, MASK, cached=True, **kw)
        out["blockwise"] = torch.stack([composite_logprobs_blockwise(model, ids, noise, d, MASK, **kw)
                                        for d in range(3)], 1)
    for name, run in (("direct", direct_backward), ("replay", replay_backward)):
        out[name] = run(model, ids, noise, MASK, lambda c: (c.sum(), {}), **kw)[2]
    # the replay's gradient pass: its composites are what it backpropagates; capture them through `backward`
    seen = []
    replay_backward(model, ids, noise, MASK, lambda c: (c.sum(), {}), backward=lambda t: seen.append(t.detach()),
                    **kw)
    out["replay_pass"] = torch.stack(seen).sum(0).expand(1)  # sum of C over all draws (g = 1)
    model.zero_grad(set_to_none=True)
    return out


def test_use_module_head_reaches_the_head_module_from_every_entry_point(bf16_head_model):
    """With bf16 head weights the module path rounds the hidden rows and the logits to bf16 (relative 2^-9 of
    logits of ~10: a few 1e-2 per log-prob, over ~15 scored tokens with weights up to 1 / t_min = 5), the default
    path does not. Composites of one path agree across entry points (layouts, chunks, the KV cache) to fp32
    rounding: composites of |C| < 500, relative errors of a few 1e-7 per layer, 1e-3 (the replay's sum of the
    B * N = 6 composites: 5e-3). The two paths are required to differ by more than 5e-2, far above both."""
    ids, resp = _batch()
    noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(0))
    fp32_path = _entry_points(bf16_head_model, ids, noise, None)
    module_path = _entry_points(bf16_head_model, ids, noise, True)
    with torch.no_grad():
        ref_default = composite_logprobs(bf16_head_model, ids, noise, [0, 1, 2], MASK, use_module_head=False)
        ref_module = torch.stack([
            composite_logprobs(bf16_head_model, ids, noise, [d], MASK, use_module_head=True)[:, 0]
            for d in range(3)], 1)  # one draw per forward: the module path reached from the smallest call
    assert (ref_default - ref_module).abs().max() > 5e-2
    for name, ref in (("default", ref_default), ("module", ref_module)):
        got = fp32_path if name == "default" else module_path
        for entry, c in got.items():
            want, tol = (ref.sum().expand(1), 5e-3) if entry == "replay_pass" else (ref, 1e-3)
            assert torch.allclose(c, want, rtol=0, atol=tol), (name, entry, c, want)


class _Recorder(torch.nn.Module):
    """The model behind another output form, recording every call's return_logits. form "tuple": (hidden,);
    "logits_first": (logits, last_hidden_state) with attribute names, its first item not the hidden states."""

    Out = namedtuple("Out", "logits last_hidden_state")

    def __init__(self, inner, form):
        super().__init__()
        self.inner, self.form, self.calls = inner, form, []
        self.config = inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, position_ids=None, return_logits=True, **kw):
        self.calls.append(return_logits)
        h = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       return_logits=False, **kw).last_hidden_state
        return (h,) if self.form == "tuple" else self.Out(logits=h.flip(-1) + 1.0, last_hidden_state=h)


@pytest.mark.parametrize("form", ["tuple", "logits_first"])
def test_the_model_is_called_without_logits_and_either_output_form_is_read(small_model, form):
    ids, resp = _batch()
    noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(0))
    rec = _Recorder(small_model, form)
    with torch.no_grad():
        for path in ("unpacked", "packed", "blockwise"):
            want = _composites(small_model, ids, noise, path)
            rec.calls.clear()
            got = _composites(rec, ids, noise, path)
            assert rec.calls and all(r is False for r in rec.calls), (path, rec.calls)
            for w, x in zip(*((want, got) if isinstance(want, tuple) else ((want,), (got,)))):
                assert torch.equal(x, w), path


def test_unwrap_hidden_reads_last_hidden_state_else_the_first_item():
    h, other = torch.randn(2, 3), torch.randn(2, 3)
    assert unwrap_hidden(_Recorder.Out(logits=other, last_hidden_state=h)) is h
    assert unwrap_hidden((h,)) is h and unwrap_hidden((h, other)) is h and unwrap_hidden([h, other]) is h
