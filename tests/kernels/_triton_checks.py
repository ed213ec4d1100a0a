"""Triton-vs-torch checks shared by the GPU tests (device="cuda") and the interpreter run (device="cpu",
TRITON_INTERPRET=1 set before import). Plain functions raising AssertionError."""
import torch

from kernels.decode import candidates
from kernels.fp8_ops import fp8_block_matmul, quantize_act_per_token_group, quantize_weight_blockwise


def _bits_equal(a, b, what):
    """Bit-for-bit equality (fp8 or fp32); on failure, how many differ and a few examples."""
    ia = a.contiguous().view(torch.uint8 if a.element_size() == 1 else torch.int32)
    ib = b.contiguous().view(torch.uint8 if b.element_size() == 1 else torch.int32)
    if torch.equal(ia, ib):
        return
    diff = (ia != ib).nonzero()
    ex = [(tuple(i), a[tuple(i)].float().item(), b[tuple(i)].float().item()) for i in diff[:4].tolist()]
    raise AssertionError(f"{what}: {len(diff)} of {a.numel()} differ (index, torch, triton): {ex}")


def check_fp8(device, shapes=((5, 300, 260), (70, 130, 128), (130, 256, 384))):
    from kernels import fp8_triton

    g = torch.Generator().manual_seed(0)
    for M, N, K in shapes:
        w = (torch.randn(N, K, generator=g) * 3).to(device)
        x = (torch.randn(M, K, generator=g) * 2).to(device)
        x[0, : min(K, 128)] = 0.0  # an all-zero group (eps scale)
        x[-1, -1] = -1e-6  # rounds to -0
        qt, st = quantize_weight_blockwise(w, backend="torch")
        qk, sk = quantize_weight_blockwise(w, backend="triton")
        _bits_equal(st, sk, f"weight scales {N}x{K}")
        _bits_equal(qt, qk, f"weight fp8 {N}x{K}")
        for xx in (x, x.bfloat16()):
            xt, xst = quantize_act_per_token_group(xx, backend="torch")
            xk, xsk = quantize_act_per_token_group(xx, backend="triton")
            _bits_equal(xst, xsk, f"act scales {M}x{K} {xx.dtype}")
            _bits_equal(xt, xk, f"act fp8 {M}x{K} {xx.dtype}")
            xk2, xsk2 = fp8_triton.act_quant(xx, 128, scale_t=True)  # column-major scales for the GEMM
            assert xsk2.stride(0) == 1 or M == 1
            _bits_equal(xsk, xsk2, "act scales, column-major")
            _bits_equal(xk, xk2, "act fp8, column-major scales")
            if xx.dtype == torch.float32:
                xq32, xs32 = xt, xst
        yt = fp8_block_matmul(x, qt, st, out_dtype=torch.float32, backend="torch")
        yk = fp8_block_matmul(x, qt, st, out_dtype=torch.float32, backend="triton")
        assert ((yt - yk).norm() / yt.norm()) < 1e-4, f"gemm {M}x{N}x{K} differs"
        yb = fp8_block_matmul(x.bfloat16(), qt, st, backend="triton")
        ybt = fp8_block_matmul(x.bfloat16(), qt, st, backend="torch")
        assert yb.dtype == torch.bfloat16 and ((yb.float() - ybt.float()).norm() / ybt.float().norm()) < 1e-2
        # pre-quantised x with row-major scales (the FP8Experts path)
        ypq = fp8_block_matmul(xq32, qt, st, out_dtype=torch.float32, backend="triton", x_scale=xs32)
        assert ((yt - ypq).norm() / yt.norm()) < 1e-4, f"gemm (pre-quantised x) {M}x{N}x{K} differs"
        ws = torch.stack([w, -w]).contiguous()
        q3, s3 = quantize_weight_blockwise(ws, backend="triton")
        _bits_equal(s3[1], st, "stacked weight scales")
        _bits_equal(q3[0], qt, "stacked weight fp8")
        assert torch.equal(q3[1].float(), -qt.float())


def check_fp8_gemm_configs(device, shapes=((200, 320, 384), (37, 300, 260))):
    """Every autotune config of the GEMM, called directly, against the torch path. Configs that do not fit
    the device (Triton OutOfResources) are reported, not failed; returns (ran, skipped) names."""
    from kernels import fp8_triton

    g = torch.Generator().manual_seed(2)
    ran, skipped = [], []
    for M, N, K in shapes:
        w = torch.randn(N, K, generator=g).to(device)
        x = torch.randn(M, K, generator=g).to(device)
        wq, ws = quantize_weight_blockwise(w, backend="torch")
        xq, xs = fp8_triton.act_quant(x, 128, scale_t=True)
        ref = fp8_block_matmul(x, wq, ws, out_dtype=torch.float32, backend="torch")
        for cfg in fp8_triton.GEMM_CONFIGS:
            name = "{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**cfg)
            try:
                y = fp8_triton.block_gemm(xq, xs, wq, ws, torch.float32, config=cfg)
            except Exception as e:  # only resource limits are tolerated
                if type(e).__name__ != "OutOfResources":
                    raise
                skipped.append(f"{name} ({e})")
                continue
            err = ((y - ref).norm() / ref.norm()).item()
            assert err < 1e-4, f"gemm config {name} on {M}x{N}x{K}: rel. error {err}"
            ran.append(f"{name} {M}x{N}x{K}")
    assert ran, f"no GEMM config ran: {skipped}"
    return ran, skipped


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


def _interpreter_numpy_shim():
    """Triton's interpreter turns a scalar tensor into an int with `int(ndarray of shape (1,))`, which
    NumPy >= 2.4 rejects (e.g. `for k in range(tl.cdiv(K, BLOCK_K))`); take the single element instead."""
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - other triton layouts: nothing to patch
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None:
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


if __name__ == "__main__":  # the interpreter run: python _triton_checks.py with TRITON_INTERPRET=1
    _interpreter_numpy_shim()
    check_fp8("cpu")
    check_fp8_gemm_configs("cpu")
    check_decode("cpu")
    print("TRITON_INTERPRET_OK")
