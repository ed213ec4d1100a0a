"""`ebpo bench check`: the headline ratios of the benchmarks against committed baselines.

Runs `ebpo bench likelihood`, `ebpo bench decode`, `ebpo bench rewards` and `ebpo bench learner --skip-w2`
(each in a subprocess, with --json), reads the ratios below and compares each with its baseline in
docs/bench/ratios_baseline.json:
a higher-is-better ratio fails below baseline * (1 - tol), a lower-is-better one above baseline * (1 + tol).
Ratios only: on a shared machine absolute times are noise, but a ratio of two timings taken side by side
keeps most of its meaning. Prints a table and exits 1 when a ratio fails (2 when a benchmark fails to run).

    ebpo bench check [--quick] [--runs N] [--only NAME,...] [--tol X] [--keep DIR]
    ebpo bench check --results DIR              # check JSON files written earlier (--keep), run nothing
    ebpo bench check --update-baseline          # measure and write the baselines (then review and commit)
    ebpo bench check --decode-set use_cache=false   # break the cache on purpose: the cache ratios fail

Every mode runs the same benchmark settings (so one baseline serves both); --quick runs each benchmark
once with fewer timing rounds (about a minute on 2 CPU cores), the default takes the median of --runs 3.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "docs" / "bench" / "ratios_baseline.json"
HELD_OUT = ROOT / "examples" / "data" / "math_eval.jsonl"


@dataclass(frozen=True)
class Ratio:
    name: str
    bench: str  # which benchmark's JSON it comes from
    read: Callable[[dict], float]
    better: str  # "higher" | "lower"
    tol: float  # default tolerance
    what: str


def _memory_ratio(r: dict) -> float:
    row = next(m for m in r["memory"] if m["mode"] == "replay" and m["cached"])
    return row["ratio_vs_n1"]


RATIOS = [
    Ratio("likelihood_cached_vs_loop", "likelihood", lambda r: r["speed"]["speedup_cached_median"], "higher", 0.3,
          "no-grad composites, block-sparse cached layout vs per-block loop (8 blocks, N=8, 1 thread)"),
    Ratio("replay_memory_vs_n1", "memory", _memory_ratio, "lower", 0.15,
          "peak activation memory, replay at N=8 (cached no-grad pass) vs direct N=1"),
    Ratio("decode_batch32_vs_batch1", "decode", lambda r: r["ratios"]["m2t"]["batch32_over_batch1"], "higher", 0.4,
          "decode tokens/s, batch 32 vs batch 1 (m2t, held-out prompts, 64 tokens, 1 thread)"),
    Ratio("decode_cache_on_vs_off_batch32", "decode", lambda r: r["ratios"]["m2t"]["cache_speedup_batch32"], "higher",
          0.35, "decode tokens/s, prefix KV cache on vs off at batch 32 (m2t)"),
    Ratio("decode_cache_on_vs_off_batch1", "decode", lambda r: r["ratios"]["m2t"]["cache_speedup_batch1"], "higher",
          0.4, "decode tokens/s, prefix KV cache on vs off at batch 1 (m2t)"),
    Ratio("learner_budget_vs_padded", "learner", lambda r: r["ratios"]["budget_vs_padded_paired"], "higher", 0.15,
          "learner train tokens/s, token-budget micro-batches vs padded (responses 8x apart, 1 thread), median of "
          "same-round pairs; the target is 1.5x"),
    Ratio("rewards_code_pool_vs_serial", "rewards", lambda r: r["code_pool_per_s"] / r["code_serial_per_s"], "higher",
          0.3, "sandboxed code executions/s, 2-worker pool vs serial"),
    Ratio("rewards_hang_overhead", "rewards", lambda r: r["hang_extra_s"] / r["hang_timeout_s"], "lower", 0.5,
          "extra seconds of a batch holding one call that hangs forever, in units of the timeout"),
]


def bench_commands(quick: bool, decode_sets: list[str]) -> dict[str, list[str]]:
    """The `ebpo bench ...` argument lists, one per benchmark (the same settings in every mode)."""
    rounds = "3" if quick else "5"
    decode = ["decode", "--prompts", str(HELD_OUT), "--presets", "m2t", "--new-tokens", "64", "--batch", "32",
              "--threads", "1"]
    for item in decode_sets:
        decode += ["--set", item]
    return {
        # one thread: with two threads on a loaded 2-core machine every OpenMP barrier waits for a descheduled
        # thread and the loop's many small operators ran 100x slower (81 s a round instead of 0.8 s), so a
        # two-thread ratio under load measures the scheduler, not the code
        "likelihood": ["likelihood", "--threads", "1", "--repeats", rounds, "--layouts", "cached", "--skip-memory"],
        "memory": ["likelihood", "--skip-speed", "--memory-configs", "replay"],
        "decode": decode,
        "rewards": ["rewards", "--math-n", "200", "--code-n", "20", "--workers", "2", "--timeout", "2"],
        # padded and budget interleaved in one process, one update of each per round (load hits both alike)
        "learner": ["learner", "--skip-w2", "--threads", "1", "--repeats", "5" if quick else "7"],
    }


def run_bench(args: list[str], out: Path, verbose: bool) -> dict:
    cmd = [sys.executable, "-m", "ebpo.cli", "bench", *args, "--json", str(out)]
    res = subprocess.run(cmd, capture_output=not verbose, text=True)
    if res.returncode != 0:
        tail = "" if verbose else (res.stdout[-2000:] + res.stderr[-2000:])
        raise RuntimeError(f"`ebpo bench {' '.join(args)}` exited {res.returncode}\n{tail}")
    return json.loads(out.read_text())


def evaluate(measured: dict[str, list[float]], baseline: dict, tol: float | None = None) -> list[dict]:
    """One row per ratio with a measurement: median of the runs, baseline, bound, pass/fail."""
    rows = []
    for ratio in RATIOS:
        values = measured.get(ratio.name)
        if not values:
            continue
        base = baseline.get(ratio.name, {})
        value = statistics.median(values)
        row = {"name": ratio.name, "value": value, "runs": values, "better": ratio.better, "what": ratio.what}
        if "value" not in base:
            rows.append({**row, "baseline": None, "bound": None, "ok": None})
            continue
        t = tol if tol is not None else base.get("tol", ratio.tol)
        bound = base["value"] * (1 - t) if ratio.better == "higher" else base["value"] * (1 + t)
        ok = value >= bound if ratio.better == "higher" else value <= bound
        rows.append({**row, "baseline": base["value"], "tol": t, "bound": bound, "ok": ok})
    return rows


def measure(names: set[str], runs: int, quick: bool, decode_sets: list[str], keep: Path | None,
            verbose: bool) -> dict[str, list[float]]:
    """Run each needed benchmark `runs` times; the ratios of every run."""
    commands = bench_commands(quick, decode_sets)
    benches = [b for b in commands if any(r.bench == b and r.name in names for r in RATIOS)]
    measured: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for bench in benches:
            for i in range(runs):
                print(f"  running ebpo bench {' '.join(commands[bench])} ({i + 1}/{runs})", flush=True)
                result = run_bench(commands[bench], folder / f"{bench}_{i}.json", verbose)
                for ratio in RATIOS:
                    if ratio.bench == bench and ratio.name in names:
                        measured.setdefault(ratio.name, []).append(float(ratio.read(result)))
    return measured


def read_results(folder: Path, names: set[str]) -> dict[str, list[float]]:
    """Ratios from JSON files written earlier (`--keep DIR`: files named BENCH_I.json)."""
    measured: dict[str, list[float]] = {}
    for ratio in RATIOS:
        if ratio.name not in names:
            continue
        for path in sorted(folder.glob(f"{ratio.bench}_*.json")):
            measured.setdefault(ratio.name, []).append(float(ratio.read(json.loads(path.read_text()))))
    return measured


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="ebpo bench check: ratios against docs/bench/ratios_baseline.json")
    for col in ("ratio", "measured (median)", "runs", "baseline", "bound", "status"):
        t.add_column(col)
    for r in rows:
        status = "no baseline" if r["ok"] is None else ("ok" if r["ok"] else "[bold red]FAIL[/]")
        bound = "-" if r["bound"] is None else (">= " if r["better"] == "higher" else "<= ") + f"{r['bound']:.2f}"
        t.add_row(r["name"], f"{r['value']:.2f}", " ".join(f"{v:.2f}" for v in r["runs"]),
                  "-" if r["baseline"] is None else f"{r['baseline']:.2f}", bound, status)
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench check", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="one run of each benchmark, 3 timing rounds (about a minute)")
    p.add_argument("--runs", type=int, default=3, help="runs of each benchmark without --quick (median taken)")
    p.add_argument("--only", default="", help="comma-separated ratio names (default: all)")
    p.add_argument("--tol", type=float, default=None, help="one tolerance for every ratio (default: the baseline's)")
    p.add_argument("--baseline", default=str(BASELINE))
    p.add_argument("--results", default=None, help="check the JSON files in this folder instead of running")
    p.add_argument("--keep", default=None, help="keep the benchmarks' JSON files in this folder")
    p.add_argument("--decode-set", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to `ebpo bench decode --set` (e.g. use_cache=false breaks the cache on purpose)")
    p.add_argument("--update-baseline", action="store_true", help="write the measured medians as the new baselines")
    p.add_argument("--verbose", action="store_true", help="show the benchmarks' own output")
    p.add_argument("--json", default=None, help="write the table as JSON here")
    a = p.parse_args(argv)
    names = {r.name for r in RATIOS}
    if a.only:
        unknown = set(a.only.split(",")) - names
        if unknown:
            p.error(f"unknown ratio(s) {sorted(unknown)}; choose from {sorted(names)}")
        names = set(a.only.split(","))
    baseline_path = Path(a.baseline)
    baseline = json.loads(baseline_path.read_text()) if baseline_path.exists() else {"ratios": {}}
    try:
        if a.results:
            measured = read_results(Path(a.results), names)
        else:
            measured = measure(names, 1 if a.quick else a.runs, a.quick, a.decode_set,
                               Path(a.keep) if a.keep else None, a.verbose)
    except (RuntimeError, KeyError, StopIteration, json.JSONDecodeError) as e:
        print(f"ebpo bench check: a benchmark failed: {e}", file=sys.stderr)
        return 2
    rows = evaluate(measured, baseline["ratios"], a.tol)
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.update_baseline:
        if a.decode_set:
            p.error("--update-baseline with --decode-set would record a broken configuration")
        ratios = dict(baseline.get("ratios", {}))
        for r in rows:
            spec = next(x for x in RATIOS if x.name == r["name"])
            ratios[r["name"]] = {"value": round(r["value"], 3), "runs": [round(v, 3) for v in r["runs"]],
                                 "tol": ratios.get(r["name"], {}).get("tol", spec.tol), "better": spec.better,
                                 "what": spec.what}
        baseline = {"updated": datetime.date.today().isoformat(),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "load_avg": [round(x, 2) for x in os.getloadavg()]},
                    "commands": {k: ("ebpo bench " + " ".join(v)).replace(f"{ROOT}/", "")
                                 for k, v in bench_commands(a.quick, []).items()},
                    "note": baseline.get("note", ""), "ratios": ratios}
        baseline_path.write_text(json.dumps(baseline, indent=1) + "\n")
        print(f"baselines written to {baseline_path}")
        return 0
    failed = [r["name"] for r in rows if r["ok"] is False]
    missing = [r["name"] for r in rows if r["ok"] is None]
    if missing:
        print(f"no baseline for: {', '.join(missing)}")
    if failed:
        print(f"FAILED: {', '.join(failed)} fell past baseline x (1 -/+ tol)")
        return 1
    print("all checked ratios within tolerance of their baselines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
