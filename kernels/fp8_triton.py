"""Triton kernels for per-block FP8 (E4M3): activation and weight quantisation and the block-scaled GEMM.

Same arithmetic as the torch fallbacks in `kernels.fp8_ops` (scale = max(amax, eps) / 448, round-to-nearest
division, clamp, round-to-nearest-even cast), so quantised values agree bit for bit up to the rare 1-ulp
tie of a different division rounding; the GEMM accumulates `dot(a_q, b_q) * a_scale * b_scale` in fp32
per 128-wide K step (DeepSeek-V3 style, the layout of vLLM's `w8a8_block_fp8_matmul`).

Only importable where `triton` is; callers go through `kernels.fp8_ops`, which dispatches.
"""
from __future__ import annotations

import torch

from ._triton import tl, triton

FP8_MAX = 448.0
EPS = 1e-10


@triton.jit
def _round_e4m3(v):
    """Round fp32 values (already clamped to +-448) to the nearest-even E4M3 value, in fp32.

    The later cast is then exact whatever the conversion rounding: Triton's CPU interpreter rounds
    values just below a power of two wrongly (e.g. 126 -> 64), and this keeps both paths bit-equal to torch.
    """
    bits = v.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = tl.maximum(e, 127 - 6)  # E4M3 subnormals share the step 2^-9 of the smallest normal binade
    # magic = 1.5 * 2^(e - 127 - 3 + 23): adding then subtracting it rounds to a multiple of 2^(e-127-3)
    magic = (((e - 3 + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _act_quant_kernel(X, Q, S, K, stride_xm, stride_qm, stride_sm,
                      G: tl.constexpr, FP8MAX: tl.constexpr, EPSV: tl.constexpr):
    # one program per (row, group of G columns)
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * G + tl.arange(0, G)
    mask = offs < K
    x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPSV)
    s = tl.math.div_rn(amax, FP8MAX)
    q = _round_e4m3(tl.clamp(tl.math.div_rn(x, s), -FP8MAX, FP8MAX))
    tl.store(Q + row * stride_qm + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + g, s)


@triton.jit
def _weight_quant_kernel(W, Q, S, N, K, stride_wb, stride_wn, stride_qb, stride_qn, stride_sb, stride_sn,
                         B: tl.constexpr, FP8MAX: tl.constexpr, EPSV: tl.constexpr):
    # one program per B x B block of matrix `e` of a stack (E, N, K)
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rn = bn * B + tl.arange(0, B)
    rk = bk * B + tl.arange(0, B)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(W + e * stride_wb + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), EPSV)
    s = tl.math.div_rn(amax, FP8MAX)
    q = _round_e4m3(tl.clamp(tl.math.div_rn(w, s), -FP8MAX, FP8MAX))
    tl.store(Q + e * stride_qb + rn[:, None] * stride_qn + rk[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + e * stride_sb + bn * stride_sn + bk, s)


@triton.jit
def _block_gemm_kernel(A, Bw, C, As, Bs, M, N, K,
                       stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       GROUP_K: tl.constexpr, GROUP_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """C (M, N) = sum over K groups of (A_q @ B_q^T) * As[m, g] * Bs[n // GROUP_N, g]; A (M, K), B (N, K)."""
    BLOCK_K: tl.constexpr = GROUP_K  # one scale per K step
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped launch order: neighbouring programs share B tiles in L2
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrap out-of-range rows/cols onto valid memory; their results are masked at the store
    offs_am = offs_m % M
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_am[:, None] * stride_am + offs_k[None, :]
    b_ptrs = Bw + offs_bn[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = As + offs_am * stride_asm
    bs_ptrs = Bs + (offs_bn // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + kk)
        b_s = tl.load(bs_ptrs + kk)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c = acc.to(C.dtype.element_ty)
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def act_quant(x2d: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d (M, K) with unit last stride -> (q (M, K) fp8 e4m3, scale (M, ceil(K/group)) fp32)."""
    M, K = x2d.shape
    g = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2d.device)
    s = torch.empty((M, g), dtype=torch.float32, device=x2d.device)
    if M > 0:
        _act_quant_kernel[(M, g)](x2d, q, s, K, x2d.stride(0), q.stride(0), s.stride(0),
                                  G=group, FP8MAX=FP8_MAX, EPSV=EPS)
    return q, s


def weight_quant(w: torch.Tensor, block: int, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """w (E, N, K) contiguous -> (q (E, N, K) fp8, scale (E, ceil(N/block), ceil(K/block)) fp32).

    `out` lets `requantize_` write into existing buffers (no reallocation after a weight sync)."""
    E, N, K = w.shape
    nb, kb = triton.cdiv(N, block), triton.cdiv(K, block)
    if out is None:
        out = (torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device),
               torch.empty((E, nb, kb), dtype=torch.float32, device=w.device))
    q, s = out
    if E * N * K > 0:
        _weight_quant_kernel[(nb, kb, E)](w, q, s, N, K, w.stride(0), w.stride(1), q.stride(0), q.stride(1),
                                          s.stride(0), s.stride(1), B=block, FP8MAX=FP8_MAX, EPSV=EPS)
    return q, s


def _gemm_config(M: int) -> dict:
    # Heuristic tiles (no autotune: the interpreter cannot time kernels). BLOCK_K is the 128 scale group.
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, GROUP_SIZE_M=8, num_warps=8, num_stages=3)


def block_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
               group: int = 128) -> torch.Tensor:
    """xq (M, K) fp8, xs (M, ceil(K/128)), wq (N, K) fp8, ws (ceil(N/128), ceil(K/128)) -> (M, N) out_dtype."""
    M, K = xq.shape
    N = wq.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return c
    cfg = _gemm_config(M)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _block_gemm_kernel[grid](xq, wq, c, xs, ws, M, N, K,
                             xq.stride(0), wq.stride(0), c.stride(0), xs.stride(0), ws.stride(0),
                             GROUP_K=group, GROUP_N=group, **cfg)
    return c
