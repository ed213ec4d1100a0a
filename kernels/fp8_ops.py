"""Per-block FP8 (E4M3) quantisation and the block-scaled matmul, with exact torch fallbacks.

Layout (DeepSeek-V3 / LLaDA2.1 FP8 inference):
  - weights (N, K): 128 x 128 blocks, one fp32 scale each -> scale (ceil(N/128), ceil(K/128));
  - activations (..., K): per token, groups of 128 along K, one fp32 scale each -> (..., ceil(K/128)).
  scale = max(amax, 1e-10) / 448 and q = clamp(x / scale, -448, 448) cast to float8_e4m3fn, both divisions
  correctly rounded on every device (see `_div_by_fp8_max`), so CPU, CUDA and Triton agree bit for bit.

`fp8_block_matmul` quantises the activations on the fly and returns x_deq @ w_deq^T. The torch path
dequantises and multiplies in fp32 (the reference); the Triton path (CUDA) multiplies fp8 tiles with fp32
accumulation and rescales per 128-wide K step: same sum, different fp32 summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
EPS = 1e-10  # amax floor: an all-zero block gets a tiny scale instead of a division by zero


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _div_by_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 with IEEE division on every device.

    On CUDA, torch evaluates `tensor / python_scalar` as `tensor * (1 / scalar)` (two roundings; it differs
    from the division for about half of all inputs), while CPU torch and the Triton kernels divide. A 0-dim
    divisor on the tensor's own device takes the elementwise division path everywhere."""
    return amax / torch.full((), FP8_MAX, dtype=amax.dtype, device=amax.device)


def quantize_weight_blockwise(w: torch.Tensor, block: int = BLOCK, backend: str = "auto",
                              out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """w (..., N, K) float -> (w_fp8 (..., N, K) float8_e4m3fn, scale (..., ceil(N/block), ceil(K/block)) fp32).

    Leading dims are independent matrices (stacked MoE experts). `out=(q, scale)` writes into existing
    tensors (used by re-quantisation after a weight sync). backend: "auto" | "torch" | "triton".
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_weight_blockwise: w must be (..., N, K), got shape {tuple(w.shape)}")
    lead, (N, K) = w.shape[:-2], w.shape[-2:]
    nb, kb = _cdiv(N, block), _cdiv(K, block)
    if out is not None and (tuple(out[0].shape) != tuple(w.shape) or tuple(out[1].shape) != (*lead, nb, kb)):
        raise ValueError(f"quantize_weight_blockwise: out shapes {tuple(out[0].shape)}, {tuple(out[1].shape)} "
                         f"do not match w {tuple(w.shape)}")
    if use_triton(backend, w):
        from . import fp8_triton

        o3 = None if out is None else (out[0].view(-1, N, K), out[1].view(-1, nb, kb))
        q, s = fp8_triton.weight_quant(w.reshape(-1, N, K).contiguous(), block, out=o3)
        q, s = q.view(*lead, N, K), s.view(*lead, nb, kb)
    else:
        wp = F.pad(w.float(), (0, kb * block - K, 0, nb * block - N)).view(*lead, nb, block, kb, block)
        s = _div_by_fp8_max(wp.abs().amax(dim=(-3, -1)).clamp_min(EPS))
        q = (wp / s[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        q = q.view(*lead, nb * block, kb * block)[..., :N, :K]
        if out is None:
            return q.contiguous(), s
    if out is not None:
        if out[0].data_ptr() != q.data_ptr():
            out[0].copy_(q)
            out[1].copy_(s)
        return out
    return q, s


def dequantize_weight_blockwise(w_fp8: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(..., N, K) fp8 and its block scales (..., ceil(N/block), ceil(K/block)) -> (..., N, K) fp32."""
    N, K = w_fp8.shape[-2:]
    s = scale.repeat_interleave(block, -2)[..., :N, :].repeat_interleave(block, -1)[..., :K]
    return w_fp8.float() * s


def quantize_act_per_token_group(x: torch.Tensor, group: int = BLOCK, backend: str = "auto"):
    """x (..., K) float -> (x_fp8 (..., K) float8_e4m3fn, scale (..., ceil(K/group)) fp32)."""
    if x.dim() < 1:
        raise ValueError("quantize_act_per_token_group: x must have at least one dimension")
    lead, K = x.shape[:-1], x.shape[-1]
    if use_triton(backend, x):
        from . import fp8_triton

        q, s = fp8_triton.act_quant(x.reshape(-1, K).contiguous(), group)
        return q.view(*lead, K), s.view(*lead, -1)
    g = _cdiv(K, group)
    xp = F.pad(x.float(), (0, g * group - K)).view(*lead, g, group)
    scale = _div_by_fp8_max(xp.abs().amax(-1).clamp_min(EPS))
    q = (xp / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, g * group)[..., :K].contiguous(), scale


def dequantize_act_per_token_group(x_fp8: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """(..., K) fp8 and its per-token group scales -> (..., K) fp32."""
    K = x_fp8.shape[-1]
    return x_fp8.float() * scale.repeat_interleave(group, -1)[..., :K]


def fp8_block_matmul(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
                     x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = quant(x) @ w^T with per-block FP8 weights: x (..., K) -> (..., N) in `out_dtype`.

    x is quantised per token in groups of 128 (pass an already-quantised fp8 x with `x_scale` to skip
    that). Triton GEMM with fp32 accumulation on CUDA; dequantise-then-fp32-matmul elsewhere.
    """
    if w_fp8.dim() != 2 or w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_block_matmul: w_fp8 must be a 2-D {FP8_DTYPE} tensor, got "
                         f"{w_fp8.dtype} {tuple(w_fp8.shape)}")
    N, K = w_fp8.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_block_matmul: x has K={x.shape[-1]} but w_fp8 is (N={N}, K={K})")
    if tuple(w_scale.shape) != (_cdiv(N, BLOCK), _cdiv(K, BLOCK)):
        raise ValueError(f"fp8_block_matmul: w_scale shape {tuple(w_scale.shape)} != "
                         f"{(_cdiv(N, BLOCK), _cdiv(K, BLOCK))}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    triton_path = use_triton(backend, x, w_fp8)
    if x.dtype == FP8_DTYPE:
        if x_scale is None:
            raise ValueError("fp8_block_matmul: an fp8 x needs its x_scale")
        xq, xs = x2, x_scale.reshape(x2.shape[0], -1)
    elif triton_path:
        from . import fp8_triton

        # scales column-major: the GEMM reads a row tile's scales of one K step contiguously
        xq, xs = fp8_triton.act_quant(x2.contiguous(), BLOCK, scale_t=True)
    else:
        xq, xs = quantize_act_per_token_group(x2, BLOCK, backend="torch")
    if triton_path:
        from . import fp8_triton

        y = fp8_triton.block_gemm(xq.contiguous(), xs.float(), w_fp8.contiguous(), w_scale.float().contiguous(),
                                  out_dtype)
    else:
        xd = dequantize_act_per_token_group(xq, xs)
        y = (xd @ dequantize_weight_blockwise(w_fp8, w_scale).t()).to(out_dtype)
    return y.view(*lead, N)
