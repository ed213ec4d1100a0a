"""Triton kernels for per-block FP8 (E4M3): activation and weight quantisation and the block-scaled GEMM.

Same arithmetic as the torch fallbacks in `kernels.fp8_ops`: scale = max(amax, eps) / 448 and x / scale both
with correctly rounded division (`tl.math.div_rn`: Triton's plain `/` may lower to an approximate division on
NVIDIA GPUs), clamp, then an explicit round-to-nearest-even to E4M3 in fp32 before the (then exact) cast, so
quantised values and scales agree bit for bit with the torch path on CPU and GPU. The GEMM accumulates
`dot(a_q, b_q) * a_scale * b_scale` in fp32 per 128-wide K step (DeepSeek-V3 style, the layout of vLLM's
`w8a8_block_fp8_matmul`), autotuned over Hopper-oriented tiles on GPU (one fixed tile under the interpreter).

Only importable where `triton` is; callers go through `kernels.fp8_ops`, which dispatches.
"""
from __future__ import annotations

import os

import torch

from ._triton import INTERPRET, tl, triton

FP8_MAX = 448.0
EPS = 1e-10
ACT_GROUPS_PER_PROGRAM = 16  # activation quantisation: one program = one row x up to 16 groups of 128


@triton.jit
def _round_e4m3(v):
    """Round fp32 values (already clamped to +-448) to the nearest-even E4M3 value, in fp32.

    The later cast is then exact whatever the conversion rounding: Triton's CPU interpreter rounds
    values just below a power of two wrongly (e.g. 126 -> 64), and this keeps both paths bit-equal to torch.
    Only adds (no multiply, so no fma contraction can change the rounding).
    """
    bits = v.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = tl.maximum(e, 127 - 6)  # E4M3 subnormals share the step 2^-9 of the smallest normal binade
    # magic = 1.5 * 2^(e - 127 - 3 + 23): adding then subtracting it rounds to a multiple of 2^(e-127-3)
    magic = (((e - 3 + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (v + magic) - magic
    # a negative value that rounds to zero gives +0 here; keep its sign (-0) like torch's cast does
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _act_quant_kernel(X, Q, S, K, NG, stride_xm, stride_qm, stride_sm, stride_sg,
                      G: tl.constexpr, GPB: tl.constexpr, FP8MAX: tl.constexpr, EPSV: tl.constexpr):
    # one program per (row, chunk of GPB groups of G columns): one read of x, one write of q and the scales
    row = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1) * GPB + tl.arange(0, GPB)  # group indices (GPB,)
    offs = gi[:, None] * G + tl.arange(0, G)[None, :]  # (GPB, G) column indices
    mask = offs < K
    x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPSV)
    s = tl.math.div_rn(amax, FP8MAX)
    q = _round_e4m3(tl.clamp(tl.math.div_rn(x, s[:, None]), -FP8MAX, FP8MAX))
    tl.store(Q + row * stride_qm + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + gi * stride_sg, s, mask=gi < NG)


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
def _block_gemm_kernel(A, Bw, C, As, Bs, M, N, K, M_KEY,
                       stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn,
                       GROUP_K: tl.constexpr, GROUP_N: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """C (M, N) = sum over K groups of (A_q @ B_q^T) * As[m, g] * Bs[n // GROUP_N, g]; A (M, K), B (N, K).

    A and B have unit stride along K. As may be row- or column-major (strides given); `M_KEY` (the
    power-of-two bucket of M) only keys the autotuner.
    """
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
    # B tile (BLOCK_K, BLOCK_N) read straight from the (N, K) weight: K-major, what fp8 wgmma wants
    b_ptrs = Bw + offs_bn[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = As + offs_am * stride_asm
    # a tile no wider than a weight-scale block (and aligned to it) needs one weight scale per K step
    SCALAR_BS: tl.constexpr = GROUP_N % BLOCK_N == 0
    if SCALAR_BS:
        bs_ptrs = Bs + ((pid_n * BLOCK_N) // GROUP_N) * stride_bsn
    else:
        bs_ptrs = Bs + (offs_bn // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + kk * stride_ask)
        b_s = tl.load(bs_ptrs + kk)
        if SCALAR_BS:
            acc += tl.dot(a, b, out_dtype=tl.float32) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b, out_dtype=tl.float32) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c = acc.to(C.dtype.element_ty)
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def act_quant(x2d: torch.Tensor, group: int, scale_t: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d (M, K) with unit last stride -> (q (M, K) fp8 e4m3, scale (M, ceil(K/group)) fp32).

    scale_t=True stores the scales column-major (a transposed view of a (groups, M) buffer), so the GEMM
    reads each K step's scales of a row tile contiguously."""
    M, K = x2d.shape
    g = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2d.device)
    s = (torch.empty((g, M), dtype=torch.float32, device=x2d.device).t() if scale_t else
         torch.empty((M, g), dtype=torch.float32, device=x2d.device))
    if M > 0 and K > 0:
        gpb = min(triton.next_power_of_2(g), ACT_GROUPS_PER_PROGRAM)
        _act_quant_kernel[(M, triton.cdiv(g, gpb))](x2d, q, s, K, g, x2d.stride(0), q.stride(0), s.stride(0),
                                                    s.stride(1), G=group, GPB=gpb, FP8MAX=FP8_MAX, EPSV=EPS,
                                                    num_warps=4 if gpb * group >= 1024 else 2)
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
                                          s.stride(0), s.stride(1), B=block, FP8MAX=FP8_MAX, EPSV=EPS,
                                          num_warps=8)
    return q, s


def _cfg(bm: int, bn: int, warps: int, stages: int, group_m: int = 8) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_SIZE_M=group_m, num_warps=warps, num_stages=stages)


# Autotune space (Hopper-oriented; BLOCK_K is fixed at the 128 scale group). Per-K-step rescaling needs the
# fresh dot result next to the accumulator (2 x BLOCK_M*BLOCK_N/threads fp32 registers), hence no 128x256.
GEMM_CONFIGS = [
    # small M (decode-sized batches): mma.sync tiles
    _cfg(16, 64, 4, 4), _cfg(16, 128, 4, 4), _cfg(32, 128, 4, 4),
    # wgmma tiles
    _cfg(64, 64, 4, 4),
    _cfg(64, 128, 4, 3), _cfg(64, 128, 4, 4), _cfg(64, 128, 4, 5),
    _cfg(64, 256, 8, 3), _cfg(64, 256, 8, 4),
    _cfg(128, 64, 4, 4),
    _cfg(128, 128, 8, 3), _cfg(128, 128, 8, 4), _cfg(128, 128, 8, 5),
]


def _m_bucket(M: int) -> int:
    """Autotune key for M: next power of two in [16, 8192] (a new token count must not re-tune)."""
    return min(max(triton.next_power_of_2(M), 16), 8192)


def _prune_configs(configs, named_args, **kwargs):
    m = named_args["M_KEY"]
    if m <= 32:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 32 or
                (c.kwargs["BLOCK_M"] == 64 and c.kwargs["BLOCK_N"] <= 128 and c.num_stages == 4)]
    elif m <= 64:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] in (32, 64)]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] >= 64]
    return keep or configs


def _autotune_bench(kernel_call, quantiles):
    # short timing runs: the default (25 ms warm-up + 100 ms per config) is too slow for many shapes
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def autotune_enabled() -> bool:
    """Autotuning runs only on a GPU: not under the interpreter, and not with EBPO_FP8_AUTOTUNE=0."""
    return not INTERPRET and os.environ.get("EBPO_FP8_AUTOTUNE", "1") != "0"


if not INTERPRET:
    import triton.testing  # noqa: F401  (do_bench)

    _block_gemm_tuned = triton.autotune(
        configs=[triton.Config({k: v for k, v in c.items() if k.isupper()}, num_warps=c["num_warps"],
                               num_stages=c["num_stages"]) for c in GEMM_CONFIGS],
        key=["M_KEY", "N", "K"], prune_configs_by={"early_config_prune": _prune_configs},
        do_bench=_autotune_bench)(_block_gemm_kernel)
else:
    _block_gemm_tuned = None


def _gemm_config(M: int) -> dict:
    """Fixed tile for the interpreter and EBPO_FP8_AUTOTUNE=0."""
    if M <= 16:
        return _cfg(16, 128, 4, 4)
    if M <= 64:
        return _cfg(64, 128, 4, 4)
    return _cfg(128, 128, 8, 4)


def block_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
               group: int = 128, config: dict | None = None) -> torch.Tensor:
    """xq (M, K) fp8, xs (M, ceil(K/128)) fp32 (any strides), wq (N, K) fp8, ws (ceil(N/128), ceil(K/128))
    -> (M, N) out_dtype. xq and wq need unit stride along K. `config` (one of GEMM_CONFIGS) bypasses the
    autotuner (tests run every config this way)."""
    M, K = xq.shape
    N = wq.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return c
    args = (xq, wq, c, xs, ws, M, N, K, _m_bucket(M),
            xq.stride(0), wq.stride(0), c.stride(0), xs.stride(0), xs.stride(1), ws.stride(0))
    meta = dict(GROUP_K=group, GROUP_N=group, EVEN_K=K % group == 0)
    if config is None and autotune_enabled():
        def grid(META):
            return (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)
        _block_gemm_tuned[grid](*args, **meta)
        return c
    cfg = config or _gemm_config(M)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _block_gemm_kernel[grid](*args, **meta, **cfg)
    return c
