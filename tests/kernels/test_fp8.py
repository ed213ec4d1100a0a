"""Per-block FP8 layers (kernels.fp8): `FP8Linear`, `FP8Experts`, model conversion and re-quantisation on the CPU,
against plain loop references."""
import copy

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8 import (FP8Experts, FP8Linear, convert_model_to_fp8, quantize_weight_blockwise, requantize_model_)


def ref_quant_block(x: torch.Tensor):
    """Plain reference for one block: scale = amax / 448, q = fp8(x / scale)."""
    scale = max(x.abs().max().item(), 1e-10) / 448.0
    scale = torch.tensor(scale, dtype=torch.float32)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def ref_dequant_weight(w: torch.Tensor):
    """Quantise then dequantise w (N, K) block by block in a loop."""
    out = torch.empty_like(w, dtype=torch.float32)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            q, s = ref_quant_block(w[i:i + 128, j:j + 128])
            out[i:i + 128, j:j + 128] = q.float() * s
    return out


def ref_dequant_act(x: torch.Tensor):
    out = torch.empty_like(x, dtype=torch.float32)
    for r in range(x.shape[0]):
        for j in range(0, x.shape[1], 128):
            q, s = ref_quant_block(x[r, j:j + 128])
            out[r, j:j + 128] = q.float() * s
    return out


def test_fp8_linear_and_requantize():
    lin = torch.nn.Linear(200, 150, bias=True)
    m = FP8Linear.from_linear(lin)
    x = torch.randn(4, 200)
    ref = ref_dequant_act(x) @ ref_dequant_weight(lin.weight.detach()).t() + lin.bias.detach()
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-4)
    new_w = torch.randn(150, 200)
    ptr = m.weight.data_ptr()
    m.requantize_(new_w)
    assert m.weight.data_ptr() == ptr  # in place, no reallocation
    torch.testing.assert_close(m(x), ref_dequant_act(x) @ ref_dequant_weight(new_w).t() + lin.bias.detach(),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        m.requantize_(torch.randn(3, 3))


class LoopExperts(torch.nn.Module):
    """Stacked experts with the model's forward contract, written as a plain loop (test reference)."""

    def __init__(self, E, H, Fd):
        super().__init__()
        self.gate_proj = torch.nn.Parameter(torch.randn(E, Fd, H) / H ** 0.5)
        self.up_proj = torch.nn.Parameter(torch.randn(E, Fd, H) / H ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, Fd) / Fd ** 0.5)

    def forward(self, x, topk_idx, topk_weight, deq=False):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(topk_idx.shape[1]):
                e = int(topk_idx[t, j])
                gw, uw, dw = self.gate_proj[e], self.up_proj[e], self.down_proj[e]
                xi = x[t:t + 1]
                if deq:
                    gw, uw, dw = (ref_dequant_weight(w.detach()) for w in (gw, uw, dw))
                    xi = ref_dequant_act(xi)
                h = F.silu(xi @ gw.t()) * (xi @ uw.t())
                if deq:
                    h = ref_dequant_act(h)
                out[t] += topk_weight[t, j] * (h @ dw.t())[0]
        return out


def test_fp8_experts_matches_loop():
    torch.manual_seed(0)
    E, H, Fd, T, k = 5, 136, 96, 7, 2
    ex = LoopExperts(E, H, Fd)
    fx = FP8Experts.from_experts(ex)
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    idx[:, 0] = 3  # expert 3 shared by all, some experts unused
    w = torch.rand(T, k)
    with torch.no_grad():
        torch.testing.assert_close(fx(x, idx, w), ex(x, idx, w, deq=True), rtol=1e-4, atol=1e-4)
        exact = ex(x, idx, w)
        assert (fx(x, idx, w) - exact).norm() / exact.norm() < 0.1
    new = torch.randn(Fd, H)
    fx.requantize_("up_proj", new, expert=3)
    q, s = quantize_weight_blockwise(new, backend="torch")
    assert torch.equal(fx.up_proj[3].float(), q.float()) and torch.equal(fx.up_proj_scale[3], s)


def _tiny_model():
    model = pytest.importorskip("ebpo.model")
    torch.manual_seed(0)
    return model.LLaDA2MoeModelLM(model.tiny_config()).eval()


def test_convert_model_structure_and_outputs():
    m = _tiny_model()
    ids = torch.randint(0, m.config.vocab_size, (2, 16))
    with torch.no_grad():
        ref = m(ids).logits
    fm = convert_model_to_fp8(copy.deepcopy(m))
    names = dict(fm.named_modules())
    assert isinstance(fm.lm_head, torch.nn.Linear) and not isinstance(fm.lm_head, FP8Linear)
    assert isinstance(fm.model.word_embeddings, torch.nn.Embedding)
    n_lin = sum(isinstance(v, FP8Linear) for v in names.values())
    n_exp = sum(isinstance(v, FP8Experts) for v in names.values())
    assert n_lin == sum(isinstance(v, torch.nn.Linear) for k, v in m.named_modules()
                        if not k.endswith(("lm_head", ".gate")))
    assert n_exp == sum(type(v).__name__ == "LLaDA2MoeExperts" for v in m.modules()) > 0
    for k, v in names.items():
        if k.endswith("mlp.gate"):
            assert not isinstance(v, FP8Linear) and v.weight.dtype == torch.float32
    with torch.no_grad():
        out = fm(ids).logits
    assert (out - ref).norm() / ref.norm() < 0.25
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.6


def test_requantize_model_matches_fresh_conversion():
    m = _tiny_model()
    fm = convert_model_to_fp8(copy.deepcopy(m))
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    requantize_model_(fm, m2.state_dict())
    fresh = convert_model_to_fp8(copy.deepcopy(m2))
    a, b = fm.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].float(), b[k].float()), k
    # released per-expert names are accepted too
    sd = dict(m.state_dict())
    for key in [k for k in sd if k.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))]:
        stacked = sd.pop(key)
        pre, proj = key.rsplit(".", 1)
        for e in range(stacked.shape[0]):
            sd[f"{pre}.{e}.{proj}.weight"] = stacked[e]
    requantize_model_(fm, sd)
    orig = convert_model_to_fp8(copy.deepcopy(m)).state_dict()
    for k, v in fm.state_dict().items():
        assert torch.equal(v.float(), orig[k].float()), k
    sd.pop("lm_head.weight")
    sd["not.a.key"] = torch.zeros(1)
    with pytest.raises(ValueError, match="lm_head.weight.*not.a.key"):
        requantize_model_(fm, sd)
