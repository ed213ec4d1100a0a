"""`ebpo bench kernels`: FP8 GEMM vs bf16 matmul, FP8 re-quantisation, fused decode step vs eager torch,
and token log-prob peak memory vs full logits, at LLaDA2.1-mini shapes. Prints a table, --json PATH.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` above the inputs; on CPU each variant runs in a
fresh subprocess: the peak-RSS mark is reset (/proc/self/clear_refs) and VmHWM minus the RSS just before
the call is reported (glibc returns large blocks to the OS, so RSS follows allocations of this size).
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

# LLaDA2.1-mini (docs/background.md section 1): (name, N out, K in)
MINI_GEMMS = [("qkv 2048->3072", 3072, 2048), ("dense 2048->2048", 2048, 2048), ("ffn up 2048->5120", 5120, 2048),
              ("ffn down 5120->2048", 2048, 5120), ("expert up 2048->512", 512, 2048),
              ("expert down 512->2048", 2048, 512)]
VOCAB = 157184


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, dev, repeats: int) -> float:
    fn()
    _sync(dev)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_gemm(dev, M: int, square: int, repeats: int) -> list[dict]:
    from kernels.fp8 import fp8_block_matmul, quantize_weight_blockwise

    rows = []
    shapes = [(n, M, N, K) for n, N, K in MINI_GEMMS] + [(f"square {square}", square, square, square)]
    dt = torch.bfloat16
    for name, m, N, K in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, K, generator=g).to(dev, dt)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dt)
        wq, ws = quantize_weight_blockwise(w)
        t_bf16 = _time(lambda: torch.matmul(x, w.t()), dev, repeats)
        t_fp8 = _time(lambda: fp8_block_matmul(x, wq, ws), dev, repeats)
        exact = x.float() @ w.float().t()
        err = ((fp8_block_matmul(x, wq, ws).float() - exact).norm() / exact.norm()).item()
        err_bf16 = ((torch.matmul(x, w.t()).float() - exact).norm() / exact.norm()).item()
        rows.append(dict(shape=name, M=m, N=N, K=K, bf16_ms=1e3 * t_bf16, fp8_ms=1e3 * t_fp8,
                         speedup=t_bf16 / t_fp8, fp8_tflops=2 * m * N * K / t_fp8 / 1e12,
                         rel_err=err, rel_err_bf16=err_bf16))
    return rows


def bench_requant(dev, n_experts: int, repeats: int) -> dict:
    """Re-quantise one mini MoE layer: qkv, dense, shared expert (3 x 512x2048) and n_experts routed experts."""
    from kernels.fp8 import FP8Experts, FP8Linear

    H, F = 2048, 512
    lin = {"qkv": (3072, H), "dense": (H, H), "sh_gate": (F, H), "sh_up": (F, H), "sh_down": (H, F)}
    mods = {k: FP8Linear(i, o, device=dev) for k, (o, i) in lin.items()}
    new = {k: torch.randn(o, i, device=dev, dtype=torch.bfloat16) for k, (o, i) in lin.items()}
    ex = FP8Experts(n_experts, H, F, device=dev)
    new_ex = {"gate_proj": torch.randn(n_experts, F, H, device=dev, dtype=torch.bfloat16),
              "up_proj": torch.randn(n_experts, F, H, device=dev, dtype=torch.bfloat16),
              "down_proj": torch.randn(n_experts, H, F, device=dev, dtype=torch.bfloat16)}

    def run():
        for k, m in mods.items():
            m.requantize_(new[k])
        for k, w in new_ex.items():
            ex.requantize_(k, w)
    t = _time(run, dev, repeats)
    n_params = sum(w.numel() for w in new.values()) + sum(w.numel() for w in new_ex.values())
    return dict(n_experts=n_experts, params_m=n_params / 1e6, ms=1e3 * t, gparams_per_s=n_params / t / 1e9,
                est_full_mini_s=t * 19 * (256 / n_experts) * 0.98)  # 19 MoE layers, experts dominate


def bench_decode(dev, B: int, K: int, repeats: int) -> list[dict]:
    from kernels.decode import candidates

    logits = torch.randn(B, K, VOCAB, device=dev) * 3
    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(B)]

    def eager_greedy():
        p = torch.softmax(logits, -1)
        return p.max(-1)

    def eager_sample():
        p = torch.softmax(logits / 0.8, -1)
        u = torch.rand(logits.shape, device=dev)
        tok = (p.log() - torch.log(-torch.log(u))).argmax(-1)
        return tok, p.gather(-1, tok[..., None])

    rows = []
    for name, fused, eager in (("greedy", lambda: candidates(logits), eager_greedy),
                               ("sample T=0.8", lambda: candidates(logits, 0.8, generators=gens), eager_sample)):
        te, tf = _time(eager, dev, repeats), _time(fused, dev, repeats)
        rows.append(dict(mode=name, B=B, K=K, V=VOCAB, eager_ms=1e3 * te, fused_ms=1e3 * tf, speedup=te / tf))
    return rows


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_rss_peak() -> bool:
    """Reset the process's peak-RSS mark (VmHWM) on Linux by writing 5 to /proc/self/clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _logprob_run(variant: str, dev_name: str, N: int, H: int, V: int, chunk: int) -> dict:
    """Forward + backward of one variant; returns peak extra bytes (see module docstring) and seconds."""
    from kernels.logprobs import token_logprobs

    dev = torch.device(dev_name)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(dev, dt).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dev, dt).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(dev)

    def step():
        if variant == "full":
            lp = torch.log_softmax((h @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)
        else:
            lp = token_logprobs(h, w, t, chunk_size=chunk)
        lp.sum().backward()
        return lp

    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lp = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        reset = _reset_rss_peak()  # else ru_maxrss may still hold the import/setup high-water mark
        rss0 = _status_kb("VmRSS") * 1024
        t0 = time.perf_counter()
        lp = step()
        hwm = _status_kb("VmHWM") * 1024 if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = hwm - rss0
    return dict(peak_bytes=int(peak), seconds=time.perf_counter() - t0, mean_logprob=float(lp.float().mean()))


def bench_logprobs(dev, N: int, H: int, chunk: int) -> dict:
    res = dict(N=N, H=H, V=VOCAB, chunk=chunk,
               full_logits_fp32_gb=N * VOCAB * 4 / 1e9)
    for variant in ("full", "chunked"):
        if dev.type == "cuda":
            r = _logprob_run(variant, "cuda", N, H, VOCAB, chunk)
        else:  # fresh process: ru_maxrss is a per-process high-water mark
            code = ("import json,sys; from ebpo.bench.kernels import _logprob_run; "
                    f"print(json.dumps(_logprob_run({variant!r}, 'cpu', {N}, {H}, {VOCAB}, {chunk})))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
        res[f"{variant}_peak_gb"] = r["peak_bytes"] / 1e9
        res[f"{variant}_s"] = r["seconds"]
        res[f"{variant}_mean_logprob"] = r["mean_logprob"]
    res["memory_ratio"] = res["full_peak_gb"] / max(res["chunked_peak_gb"], 1e-9)
    return res


def _print(res: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(json.dumps(res, indent=1))
        return
    con = Console()
    for key in ("gemm", "decode"):
        rows = res[key]
        t = Table(title=f"{key} ({res['device']})")
        for c in rows[0]:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()])
        con.print(t)
    for key in ("requant", "logprobs"):
        t = Table(title=key)
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in res[key].items():
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
        con.print(t)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench kernels")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--tokens", type=int, default=None, help="GEMM rows M (default 4096 on GPU, 256 on CPU)")
    p.add_argument("--square", type=int, default=None, help="square GEMM size (default 4096 GPU, 1024 CPU)")
    p.add_argument("--experts", type=int, default=None, help="routed experts re-quantised (default 256 GPU, 32 CPU)")
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--lp-tokens", type=int, default=None, help="log-prob tokens N (default 16384 GPU, 2048 CPU)")
    p.add_argument("--lp-hidden", type=int, default=None, help="hidden size (default 2048 GPU, 256 CPU)")
    p.add_argument("--lp-chunk", type=int, default=None, help="token_logprobs chunk (default 2048 GPU, 256 CPU)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    gpu = dev.type == "cuda"
    from kernels import HAS_TRITON

    res = {"device": torch.cuda.get_device_name(dev) if gpu else f"CPU ({platform.processor() or 'x86'}, "
                                                                 f"{torch.get_num_threads()} threads)",
           "torch": torch.__version__, "triton": HAS_TRITON and gpu,
           "backend": "triton" if HAS_TRITON and gpu else "torch fallback"}
    reps = a.repeats or (20 if gpu else 3)
    res["gemm"] = bench_gemm(dev, a.tokens or (4096 if gpu else 256), a.square or (4096 if gpu else 1024), reps)
    res["requant"] = bench_requant(dev, a.experts or (256 if gpu else 32), reps)
    res["decode"] = bench_decode(dev, a.decode_batch, 32, reps)
    res["logprobs"] = bench_logprobs(dev, a.lp_tokens or (16384 if gpu else 2048), a.lp_hidden or (2048 if gpu else 256),
                                     a.lp_chunk or (2048 if gpu else 256))
    sq = res["gemm"][-1]
    res["targets"] = {"fp8_square_speedup>=1.4": sq["speedup"] >= 1.4,
                      "logprob_memory_ratio>=4": res["logprobs"]["memory_ratio"] >= 4}
    _print(res)
    print("targets:", res["targets"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
