"""`ebpo bench prefix`: shared prompt prefixes on an RL-like rollout step (512-token prompts, G = 8 samples each).

    ebpo bench prefix                                  # tiny model, 4 prompts x 8 samples, 512-token prompts
    ebpo bench prefix --json docs/bench/prefix_cpu.json

The same sequences (same prompts, seeds, settings and long-tailed lengths: one in `--tail-every` gets
`--tail-factor` x the budget, as in an RL step) are decoded by one engine twice: with its prompt sharing off
(every sample runs its prompt's blocks) and on (`rollout.prefix_share`: the first sample of a group runs them,
the others reference its pages). Reported per run: prompt tokens computed per sequence (hardware-independent),
wall seconds of the step on this machine and the process's CPU seconds (with one torch thread, what the step
costs whatever else the machine runs), forwards, whether every sequence's tokens are identical, and the KV
cache's memory: the peak bytes of its pages in use against the peak bytes of the live tokens (every row's cached
positions), and what a dense cache of `max_batch` x canvas positions holds. The two runs alternate `--repeats`
times so that a change of the machine's load hits both.
"""
from __future__ import annotations

import argparse
import json
import platform
import time


def _run(model, cfg, prompts: list[list[int]], seeds: list[int], lengths: list[int], max_batch: int,
         share: bool) -> dict:
    import torch

    from rollout.engine import Engine

    K = model.config.block_size
    T = max(-(-(len(p) + m) // K) * K for p, m in zip(prompts, lengths))
    t0, c0 = time.perf_counter(), time.process_time()
    engine = Engine(model, cfg, max_batch=max_batch, canvas_len=T, share_prefix=share)
    for p, s, m in zip(prompts, seeds, lengths):
        engine.submit(p, torch.Generator().manual_seed(s), max_new_tokens=m)
    memory = _Memory(engine.runner.cache)
    with torch.no_grad():
        done = engine.run(until=memory.sample)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"share_prefix": share, "wall_s": wall, "cpu_s": cpu, "forwards": engine.num_forwards,
            "prompt_tokens_computed": engine.runner.prompt_tokens_computed,
            "prompt_tokens_per_sequence": engine.runner.prompt_tokens_computed / len(prompts),
            **memory.report(max_batch, T),
            "tokens": [q.canvas[q.prompt_len:q.prompt_len + q.max_new] for q in done]}


class _Memory:
    """The KV cache's pages in use after every step against the live tokens (every row's cached positions)."""

    def __init__(self, cache):
        self.cache, self.peak_bytes, self.live_at_peak, self.peak_live = cache, 0, 0, 0

    def sample(self) -> bool:
        c = self.cache
        per_token = c.page_bytes() // c.page
        used, live = c.pages_in_use * c.page_bytes(), sum(c.lengths) * per_token
        if used > self.peak_bytes:
            self.peak_bytes, self.live_at_peak = used, live
        self.peak_live = max(self.peak_live, live)
        return False  # never stops the run

    def report(self, max_batch: int, T: int) -> dict:
        c = self.cache
        per_token = c.page_bytes() // c.page
        return {"kv_peak_bytes": self.peak_bytes, "kv_live_bytes_at_peak": self.live_at_peak,
                "kv_peak_live_bytes": self.peak_live, "kv_pool_bytes": c.pool_pages * c.page_bytes(),
                "kv_peak_over_live": self.peak_bytes / max(self.peak_live, 1),
                "kv_dense_bytes": max_batch * T * per_token}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset (random weights): tiny, mini, ...")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--tail-every", type=int, default=8,
                   help="one sequence in this many (a seeded draw) gets --tail-factor x --max-new (0: none)")
    p.add_argument("--tail-factor", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--mode", default="quality", help="decoding preset (sampled at --temperature)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    import torch

    from ebpo.model import LLaDA2MoeModelLM, load_preset
    from rollout import DecodeConfig

    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaDA2MoeModelLM(load_preset(a.preset)).eval()
    vocab = model.config.vocab_size
    base = [torch.randint(8, vocab - 8, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    prompts = [q for q in base for _ in range(a.group)]
    seeds = list(range(len(prompts)))
    long_rows = set(torch.randperm(len(prompts), generator=g)[: len(prompts) // a.tail_every].tolist()
                    if a.tail_every else [])
    lengths = [a.max_new * a.tail_factor if i in long_rows else a.max_new for i in range(len(prompts))]
    cfg = DecodeConfig.preset(a.mode, temperature=a.temperature, max_new_tokens=a.max_new, stop_at_eos=False)
    runs: dict = {False: [], True: []}
    for _ in range(a.repeats):
        for share in (False, True):
            runs[share].append(_run(model, cfg, prompts, seeds, lengths, a.max_batch, share))
    same = all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values() for r in rs)
    out = {}
    for share, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        out["on" if share else "off"] = {k: v for k, v in best.items() if k != "tokens"} | {
            "wall_s_all": [r["wall_s"] for r in rs], "cpu_s_all": [r["cpu_s"] for r in rs]}
    res = {"bench": "prefix", "preset": a.preset, "prompts": a.prompts, "group": a.group, "prompt_len": a.prompt_len,
           "max_new": a.max_new, "tail_every": a.tail_every, "tail_factor": a.tail_factor,
           "max_batch": a.max_batch, "mode": a.mode, "temperature": a.temperature,
           "torch_threads": torch.get_num_threads(), "machine": platform.machine(), "identical_tokens": same,
           "runs": out,
           "prompt_tokens_ratio": out["off"]["prompt_tokens_computed"] / max(out["on"]["prompt_tokens_computed"], 1),
           "wall_ratio": out["off"]["wall_s"] / out["on"]["wall_s"],
           "cpu_ratio": min(out["off"]["cpu_s_all"]) / min(out["on"]["cpu_s_all"])}
    _print(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if same else 1


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ebpo bench prefix ({res['preset']}, {res['prompts']} prompts x G={res['group']}, "
                    f"{res['prompt_len']}-token prompts, {res['max_new']} new tokens)")
    for col in ("prompt sharing", "prompt tokens / sequence", "forwards", "wall s (best)", "CPU s (best)", "peak KV MB",
                "peak live-token KV MB", "peak / live", "dense cache MB"):
        t.add_column(col)
    for k, r in res["runs"].items():
        t.add_row(k, f"{r['prompt_tokens_per_sequence']:.0f}", str(r["forwards"]), f"{r['wall_s']:.2f}",
                  f"{min(r['cpu_s_all']):.2f}",
                  f"{r['kv_peak_bytes'] / 2**20:.1f}", f"{r['kv_peak_live_bytes'] / 2**20:.1f}",
                  f"{r['kv_peak_over_live']:.2f}", f"{r['kv_dense_bytes'] / 2**20:.1f}")
    Console().print(t)
    print(f"prompt tokens computed {res['prompt_tokens_ratio']:.2f}x fewer, wall time {res['wall_ratio']:.2f}x lower, "
          f"process CPU time {res['cpu_ratio']:.2f}x lower; "
          f"identical tokens: {res['identical_tokens']}")
