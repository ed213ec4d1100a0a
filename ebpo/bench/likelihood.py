"""`ebpo bench likelihood`: vectorized block-ELBO vs the per-block loop, and peak memory of gradient replay.

Speed: the N composites of a batch without grad (the old-policy pass), three ways:
  loop     - one forward per (draw, block): `[clean blocks < b ; noisy block b]`, block-causal mask;
  vector   - one forward per call, `[noisy_n ; clean]` for all N draws stacked in the batch (2NL tokens);
  packed   - one forward, `[noisy_1 .. noisy_N ; clean]` ((N+1)L tokens);
  cached   - the learner's default for no-grad passes: block by block, each forward runs the same blocks
             of the N noisy copies and of the clean copy against the clean prefix in a KV cache, with
             block-sparse attention that computes no masked-out score ((N+1)L tokens);
  cached_dense - the clean copy once into the cache, then the N noisy copies in one forward whose queries
             attend 2L keys through a dense mask (the default until 2026-11-23).
The layouts are timed interleaved, round by round; each speed-up is reported as the ratio of medians and
as the median, min and max of the per-round ratios (the machine may be shared: say which).
Target (issue 21): cached at least 6x the loop with 2 threads and 4x with 1 thread, 8 blocks, N = 8.

Memory: one forward+backward of the EBPO loss in a fresh subprocess per configuration; the peak is
`resource.getrusage(RUSAGE_SELF).ru_maxrss` and the reported activation peak is that minus the RSS
measured right before the step (model, batch and noise already built), so interpreter and library
memory cancel. Target: replay at N = 8 within 1.3x of N = 1.
"""
from __future__ import annotations

import argparse
import json
import os
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


def _times(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each function over `repeats` rounds, the functions interleaved within a round (so a
    change in the machine's load hits all of them alike); one warm-up call each first."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


LAYOUTS = ("vector", "packed", "cached", "cached_dense")


def speed(args) -> dict:
    from ebpo.core.likelihood import all_composites, composite_logprobs_blockwise, composite_logprobs_cached

    model, ids, _, noise = _setup(args, args.n_draws)
    model.eval()
    mask = model.config.mask_token_id
    N = args.n_draws
    every = {
        "loop": lambda: torch.stack([composite_logprobs_blockwise(model, ids, noise, n, mask) for n in range(N)], 1),
        "vector": lambda: all_composites(model, ids, noise, mask, packed=False),
        "packed": lambda: all_composites(model, ids, noise, mask, packed=True),
        "cached": lambda: all_composites(model, ids, noise, mask, cached=True),
        "cached_dense": lambda: composite_logprobs_cached(model, ids, noise, range(N), mask, by_block=False),
    }
    layouts = [name for name in LAYOUTS if name in args.layouts.split(",")]
    fns = {name: every[name] for name in ["loop", *layouts]}
    with torch.no_grad():
        ref = fns["loop"]()
        diffs = {name: float((fns[name]() - ref).abs().max()) for name in layouts}
        times = _times(fns, args.repeats)
    out: dict = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    out["runs_s"] = times
    for name in layouts:
        out[f"max_abs_diff_{name}_vs_loop"] = diffs[name]
        # ratio of each round's loop time to the same round's layout time: median and spread over rounds
        ratios = [lo / t for lo, t in zip(times["loop"], times[name])]
        out[f"speedup_{name}"] = out["loop_s"] / out[f"{name}_s"]
        out[f"speedup_{name}_runs"] = ratios
        out[f"speedup_{name}_median"] = statistics.median(ratios)
        out[f"speedup_{name}_min"], out[f"speedup_{name}_max"] = min(ratios), max(ratios)
    out["target_speedup"] = 6.0 if args.threads >= 2 else 4.0
    if "cached" in layouts:
        out["speed_target_met"] = out["speedup_cached_median"] >= out["target_speedup"]
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
    if args.memory_configs == "replay":  # N = 1 and the learner's default (replay, cached no-grad pass) only
        configs = [configs[0], configs[-1]]
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
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"layouts timed against the loop, from {LAYOUTS}")
    p.add_argument("--memory-configs", choices=("all", "replay"), default="all",
                   help="replay: only N = 1 and the default replay configuration (two subprocesses)")
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
    load_before = [round(x, 2) for x in os.getloadavg()]
    result = {"config": {k: v for k, v in vars(args).items() if k not in internal},
              "speed": speed(args) if not args.skip_speed else None,
              "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()]}
    result["loaded"] = args.threads > 1 and max(load_before[0], result["load_after"][0]) > (os.cpu_count() or 1)
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

    console = Console()
    s = result["speed"]
    if s is None:
        return _print_memory(result, console)
    t = Table(title="composites without grad (median seconds)")
    for col in ("layout", "seconds", "speed-up vs loop", "per-round speed-up: median (min-max)", "max |diff| vs loop"):
        t.add_column(col)
    t.add_row("per-block loop", f"{s['loop_s']:.4f}", "1.00", "-", "-")
    names = {"vector": "vectorized [noisy;clean]", "packed": "packed [noisy_1..N;clean]",
             "cached": "cached, block-sparse (default)", "cached_dense": "cached, one pass, dense mask"}
    for key, label in names.items():
        if key + "_s" not in s:
            continue
        t.add_row(label, f"{s[key + '_s']:.4f}", f"{s['speedup_' + key]:.2f}",
                  f"{s['speedup_' + key + '_median']:.2f} ({s['speedup_' + key + '_min']:.2f}-"
                  f"{s['speedup_' + key + '_max']:.2f})", f"{s['max_abs_diff_' + key + '_vs_loop']:.2e}")
    console.print(t)
    if "speed_target_met" in s:
        console.print(f"speed target (cached, median per-round >= {s['target_speedup']:.1f}x with "
                      f"{result['config']['threads']} thread(s)): {'met' if s['speed_target_met'] else 'NOT met'}")
    console.print(f"load average before/after: {result['load_before']} / {result['load_after']}")
    if result["loaded"]:
        console.print(f"[bold yellow]the machine was busy (1-minute load average above {os.cpu_count()} cores): with "
                      f"{result['config']['threads']} threads every OpenMP barrier waits for a descheduled thread, so "
                      "these timings measure the scheduler more than the code; rerun when it is quiet, or use "
                      "--threads 1[/]")
    _print_memory(result, console)


def _print_memory(result: dict, console) -> None:
    from rich.table import Table

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
