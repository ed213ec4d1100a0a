"""Triton-vs-torch checks shared by the GPU tests (device="cuda") and the interpreter run (device="cpu",
TRITON_INTERPRET=1 set before import). Plain functions raising AssertionError."""
import torch

from kernels.decode import candidates
from kernels.fp8_ops import fp8_block_matmul, quantize_act_per_token_group, quantize_weight_blockwise


def check_fp8(device, shapes=((5, 300, 260), (70, 130, 128), (130, 256, 384))):
    g = torch.Generator().manual_seed(0)
    for M, N, K in shapes:
        w = (torch.randn(N, K, generator=g) * 3).to(device)
        x = (torch.randn(M, K, generator=g) * 2).to(device)
        qt, st = quantize_weight_blockwise(w, backend="torch")
        qk, sk = quantize_weight_blockwise(w, backend="triton")
        assert torch.equal(st, sk), "weight scales differ"
        # division rounding may differ in rare ties on hardware: allow a handful of 1-ulp differences
        assert (qt.float() != qk.float()).float().mean() < 1e-3, "weight quantisation differs"
        xt, xst = quantize_act_per_token_group(x, backend="torch")
        xk, xsk = quantize_act_per_token_group(x, backend="triton")
        assert torch.equal(xst, xsk) and (xt.float() != xk.float()).float().mean() < 1e-3
        yt = fp8_block_matmul(x, qt, st, out_dtype=torch.float32, backend="torch")
        yk = fp8_block_matmul(x, qt, st, out_dtype=torch.float32, backend="triton")
        assert ((yt - yk).norm() / yt.norm()) < 1e-4, f"gemm {M}x{N}x{K} differs"
        yb = fp8_block_matmul(x.bfloat16(), qt, st, backend="triton")
        ybt = fp8_block_matmul(x.bfloat16(), qt, st, backend="torch")
        assert yb.dtype == torch.bfloat16 and ((yb.float() - ybt.float()).norm() / ybt.float().norm()) < 1e-2
        ws = torch.stack([w, -w]).contiguous()
        q3, s3 = quantize_weight_blockwise(ws, backend="triton")
        assert torch.equal(s3[1], st) and (q3[1].float() != -qt.float()).float().mean() < 1e-3


def check_decode(device, V=1000):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, V, generator=g) * 3).to(device)
    x[0, 0, 5] = x[0, 0, 7] = 100.0
    sup = torch.tensor([[5, -1, 3], [-1, -1, 0]], device=device)
    for kw in ({}, {"suppress": sup, "penalty": 3.0}):
        a, b = candidates(x, backend="torch", **kw), candidates(x, backend="triton", **kw)
        assert torch.equal(a[0], b[0]), "greedy tokens differ"
        torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    # sampling: reproducible per generator, independent of batch neighbours, right distribution and prob
    def gens(seeds):
        return [torch.Generator(device=device).manual_seed(s) for s in seeds]
    s1 = candidates(x, temperature=0.9, generators=gens([3, 4]), backend="triton")
    s2 = candidates(x, temperature=0.9, generators=gens([3, 4]), backend="triton")
    s3 = candidates(x[1:], temperature=0.9, generators=gens([4]), backend="triton")
    assert torch.equal(s1[0], s2[0]) and torch.equal(s3[0][0], s1[0][1])
    ref = torch.softmax(x.float() / 0.9, -1).gather(-1, s1[0][..., None]).squeeze(-1)
    torch.testing.assert_close(s1[1], ref, rtol=1e-4, atol=1e-6)
    base = torch.randn(6, generator=g).to(device)
    K = 4000
    tok, prob = candidates(base.expand(1, K, 6).contiguous(), temperature=0.7, generators=gens([9]), backend="triton")
    p = torch.softmax(base.float() / 0.7, -1)
    freq = torch.bincount(tok[0], minlength=6).float() / K
    assert (freq - p).abs().max() < 4 * (0.25 / K) ** 0.5 + 1e-3, (freq, p)
    tk, pk = candidates(base.expand(1, 50, 6).contiguous(), temperature=1.0, top_k=2, generators=gens([2]),
                        backend="triton")
    assert set(tk.flatten().tolist()) <= set(base.topk(2).indices.tolist())


if __name__ == "__main__":  # the interpreter run: python _triton_checks.py with TRITON_INTERPRET=1
    check_fp8("cpu")
    check_decode("cpu")
    print("TRITON_INTERPRET_OK")
