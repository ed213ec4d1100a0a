"""Per-block FP8 (E4M3) quantisation and the block-scaled matmul (kernels.fp8_ops): the torch fallbacks on the CPU
against plain loop references."""
import pytest
import torch

from kernels.fp8_ops import (dequantize_weight_blockwise, fp8_block_matmul,
                             quantize_act_per_token_group, quantize_weight_blockwise)


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


@pytest.mark.parametrize("shape", [(200, 130), (128, 256), (5, 7)])
def test_weight_quant_matches_loop(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 5
    w[:3, :3] = 0.0  # partly zero block still fine
    q, s = quantize_weight_blockwise(w, backend="torch")
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    torch.testing.assert_close(dequantize_weight_blockwise(q, s), ref_dequant_weight(w), rtol=0, atol=0)
    # relative error of E4M3 (3 mantissa bits): at most 2^-4 per element relative to its block amax scale
    assert (dequantize_weight_blockwise(q, s) - w).abs().max() <= w.abs().max() / 16


def test_weight_quant_stacked_and_zero_block():
    w = torch.randn(3, 130, 260)
    w[1] = 0
    q, s = quantize_weight_blockwise(w, backend="torch")
    for e in range(3):
        qe, se = quantize_weight_blockwise(w[e], backend="torch")
        assert torch.equal(qe.float(), q[e].float()) and torch.equal(se, s[e])
    assert torch.all(q[1].float() == 0) and torch.isfinite(s).all()


def test_act_quant_matches_loop():
    x = torch.randn(6, 300) * 4
    q, s = quantize_act_per_token_group(x, backend="torch")
    assert s.shape == (6, 3)
    deq = q.float() * s.repeat_interleave(128, -1)[:, :300]
    torch.testing.assert_close(deq, ref_dequant_act(x), rtol=0, atol=0)
    q3, s3 = quantize_act_per_token_group(x.view(2, 3, 300), backend="torch")
    assert torch.equal(q3.view(6, 300).float(), q.float()) and torch.equal(s3.view(6, 3), s)


def test_block_matmul_is_dequantise_then_matmul():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 9, 300, generator=g), torch.randn(260, 300, generator=g)
    q, s = quantize_weight_blockwise(w, backend="torch")
    y = fp8_block_matmul(x, q, s, out_dtype=torch.float32, backend="torch")
    ref = ref_dequant_act(x.view(-1, 300)) @ ref_dequant_weight(w).t()
    torch.testing.assert_close(y.view(-1, 260), ref, rtol=1e-5, atol=1e-4)
    exact = x.view(-1, 300) @ w.t()
    assert ((y.view(-1, 260) - exact).norm() / exact.norm()) < 0.06  # E4M3 rounding on both operands
    assert fp8_block_matmul(x, q, s, backend="torch").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K="):
        fp8_block_matmul(x[..., :10], q, s)
