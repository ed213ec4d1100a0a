"""`ebpo bench likelihood`: vectorized block-ELBO vs the per-block loop, and peak memory of gradient replay.

Speed: the N composites of a batch without grad (the old-policy pass), three ways:
  loop     - one forward per (draw, block): `[clean blocks < b ; noisy block b]`, block-causal mask;
  vector   - one forward per call, `[noisy_n ; clean]` for all N draws stacked in the batch (2NL tokens);
  packed   - one forward, `[noisy_1 .. noisy_N ; clean]` ((N+1)L tokens);
  cached   - the clean copy once into a KV cache, then the N noisy copies against it (the learner's
             default for no-grad passes; (N+1)L tokens, 2L keys per noisy query).
Target: vector (or packed) at least num_blocks / 2 times faster than loop at 8 blocks.

Memory: one forward+backward of the EBPO loss in a fresh subprocess per configuration; the peak is
`resource.getrusage(RUSAGE_SELF).ru_maxrss` and the reported activation peak is that minus the RSS
measured right before the step (model, batch and noise already built), so interpreter and library
memory cancel. Target: replay at N = 8 within 1.3x of N = 1.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def _setup(args, n_draws: int):
    from ebpo.core.likelihood import draw_noise
    from ebpo.model import LLaDA2MoeModelLM, tiny_config

    torch.manual_seed(0)
    K = args.block_size
    model = LLaDA2MoeModelLM(tiny_config(block_size=K, hidden_size=args.hidden, num_hidden_layers=args.layers))
    L = args.blocks * K
    prompt = K // 2  # the prompt ends inside block 0, so all `blocks` blocks hold response tokens
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, L), generator=g)
    resp = torch.zeros(args.batch, L, dtype=torch.bool)
    resp[:, prompt:] = True
    noise = draw_noise(resp, K, n_draws, 0.1, 1.0, g)
    return model, ids, resp, noise


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(args) -> dict:
    from ebpo.core.likelihood import all_composites, composite_logprobs_blockwise

    model, ids, _, noise = _setup(args, args.n_draws)
    model.eval()
    mask = model.config.mask_token_id
    N = args.n_draws
    with torch.no_grad():
        ref = torch.stack([composite_logprobs_blockwise(model, ids, noise, n, mask) for n in range(N)], 1)
        vec = all_composites(model, ids, noise, mask, packed=False)
        pk = all_composites(model, ids, noise, mask, packed=True)
        ca = all_composites(model, ids, noise, mask, cached=True)
        out = {
            "loop_s": _time(lambda: [composite_logprobs_blockwise(model, ids, noise, n, mask) for n in range(N)],
                            args.repeats),
            "vector_s": _time(lambda: all_composites(model, ids, noise, mask, packed=False), args.repeats),
            "packed_s": _time(lambda: all_composites(model, ids, noise, mask, packed=True), args.repeats),
            "cached_s": _time(lambda: all_composites(model, ids, noise, mask, cached=True), args.repeats),
        }
    out["max_abs_diff_vector_vs_loop"] = float((vec - ref).abs().max())
    out["max_abs_diff_packed_vs_loop"] = float((pk - ref).abs().max())
    out["max_abs_diff_cached_vs_loop"] = float((ca - ref).abs().max())
    for name in ("vector", "packed", "cached"):
        out[f"speedup_{name}"] = out["loop_s"] / out[f"{name}_s"]
    out["target_speedup"] = args.blocks / 2
    out["speed_target_met"] = max(out[f"speedup_{n}"] for n in ("vector", "packed", "cached")) >= args.blocks / 2
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_child(args) -> dict:
    """One forward+backward of the EBPO loss; returns peak RSS above the pre-step RSS (bytes)."""
    from ebpo.core.algos import ebpo_loss
    from ebpo.core.likelihood import direct_backward, replay_backward

    model, ids, resp, noise = _setup(args, args.n_draws)
    model.train()
    mask = model.config.mask_token_id
    old = torch.zeros(args.batch, args.n_draws)
    adv = torch.linspace(-1, 1, args.batch)

    def loss_fn(c):
        return ebpo_loss(c, old, adv, 0.2, 0.28, lengths=resp.sum(1).float())

    base = _rss_bytes()
    if args.mode == "replay":
        replay_backward(model, ids, noise, mask, loss_fn, packed=args.packed, nograd_chunk=args.nograd_chunk,
                        replay_chunk=1, cached=args.cached)
    else:
        direct_backward(model, ids, noise, mask, loss_fn, packed=args.packed)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"base_rss": base, "peak_rss": peak, "activation_peak": peak - base}


def memory(args) -> list[dict]:
    # (mode, N, packed, no-grad draws per forward, cached no-grad pass)
    configs = [("direct", 1, False, 1, False), ("direct", args.n_draws, False, 0, False),
               ("direct", args.n_draws, True, 0, False), ("replay", args.n_draws, False, 1, False),
               ("replay", args.n_draws, True, 0, False), ("replay", args.n_draws, True, 0, True)]
    rows = []
    for mode, n, packed, chunk, cached in configs:
        cmd = [sys.executable, "-m", "ebpo.bench.likelihood", "--child", "--mode", mode, "--n-draws", str(n),
               "--nograd-chunk", str(chunk), "--blocks", str(args.blocks), "--block-size", str(args.block_size),
               "--batch", str(args.batch), "--hidden", str(args.hidden), "--layers", str(args.layers)]
        cmd += ["--packed"] if packed else []
        cmd += ["--cached"] if cached else []
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append({"mode": mode, "n_draws": n, "packed": packed, "nograd_chunk": chunk, "cached": cached, **row})
    ref = rows[0]["activation_peak"]
    for r in rows:
        r["ratio_vs_n1"] = r["activation_peak"] / max(ref, 1)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench likelihood", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=8, help="blocks per sequence (all hold response tokens)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--n-draws", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = stable timings)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="direct", help=argparse.SUPPRESS)
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cached", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nograd-chunk", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(memory_child(args)))
        return 0
    internal = ("child", "mode", "packed", "nograd_chunk", "cached")
    result = {"config": {k: v for k, v in vars(args).items() if k not in internal},
              "speed": speed(args)}
    if not args.skip_memory:
        result["memory"] = memory(args)
        replay = [r for r in result["memory"] if r["mode"] == "replay"]
        result["memory_target_met"] = min(r["ratio_vs_n1"] for r in replay) <= 1.3
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["speed"]
    t = Table(title="composites without grad (median seconds)")
    for col in ("layout", "seconds", "speed-up vs loop", "max |diff| vs loop"):
        t.add_column(col)
    t.add_row("per-block loop", f"{s['loop_s']:.4f}", "1.00", "-")
    t.add_row("vectorized [noisy;clean]", f"{s['vector_s']:.4f}", f"{s['speedup_vector']:.2f}",
              f"{s['max_abs_diff_vector_vs_loop']:.2e}")
    t.add_row("packed [noisy_1..N;clean]", f"{s['packed_s']:.4f}", f"{s['speedup_packed']:.2f}",
              f"{s['max_abs_diff_packed_vs_loop']:.2e}")
    t.add_row("cached clean + N noisy", f"{s['cached_s']:.4f}", f"{s['speedup_cached']:.2f}",
              f"{s['max_abs_diff_cached_vs_loop']:.2e}")
    console = Console()
    console.print(t)
    console.print(f"speed target (>= {s['target_speedup']:.1f}x): {'met' if s['speed_target_met'] else 'NOT met'}")
    if "memory" in result:
        m = Table(title="peak memory of one EBPO forward+backward (RSS above pre-step RSS)")
        for col in ("mode", "N", "packed", "no-grad chunk", "cached", "MiB", "x N=1"):
            m.add_column(col)
        for r in result["memory"]:
            m.add_row(r["mode"], str(r["n_draws"]), str(r["packed"]), str(r["nograd_chunk"]), str(r["cached"]),
                      f"{r['activation_peak'] / 2 ** 20:.1f}", f"{r['ratio_vs_n1']:.2f}")
        console.print(m)
        console.print(f"memory target (replay <= 1.3x N=1): {'met' if result['memory_target_met'] else 'NOT met'}")


if __name__ == "__main__":
    raise SystemExit(main())
