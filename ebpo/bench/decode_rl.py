"""`ebpo bench decode --rl-workload`: continuous batching against fixed batches on an RL-like rollout workload.

The workload looks like a GRPO rollout step: `prompts` prompts x `group` samples each, sampled at temperature
1 with one seed per sample, more sequences than `max_batch`, and long-tailed lengths: one sample in eight
(chosen by a seeded draw) gets four times the budget of the others. EOS stop is off, so every sequence
decodes exactly its budget: the lengths are the workload's, not the model's.

Two schedules decode the same sequences with the same seeds (so the same tokens, checked):
  - fixed: consecutive batches of `max_batch` sequences, each decoded until its last sequence finishes
    (finished rows leave, their slots stay empty) - the schedule of the decoders before the engine, kept here
    only as the baseline;
  - engine: one `rollout.generate` call with `max_batch` slots; a finished sequence's slot takes the next one
    at the next forward.
Reported per schedule: forwards (model calls) per 1,000 generated tokens, the hardware-independent figure (on
a GPU at these batch sizes a forward costs about the same whatever its row count), mean rows per forward, and
CPU tokens/s. The schedules alternate `repeats` times so that a change in the machine's load hits both.
"""
from __future__ import annotations

import time


def workload(n_prompts: int, group: int, short: int, tail_every: int, tail_factor: int, seed: int,
             vocab: int, prompt_len: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompts, seeds, lengths), one entry per sequence: each prompt repeated `group` times (random ids in
    [8, vocab)), seeds 0..n-1, and `short` new tokens except one sequence in `tail_every` (a seeded draw)
    that gets `short * tail_factor`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(8, vocab, (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]
    prompts = [p for p in base for _ in range(group)]
    n = len(prompts)
    long_rows = set(torch.randperm(n, generator=g)[: max(1, n // tail_every)].tolist())
    lengths = [short * tail_factor if i in long_rows else short for i in range(n)]
    return prompts, list(range(n)), lengths


def _decode(model, prompts, seeds, lengths, config, max_batch: int, fixed: bool) -> dict:
    """One schedule through `rollout.engine.Engine` (the fixed one: a fresh engine per consecutive chunk of
    `max_batch` sequences, so nothing joins a running batch); its forwards, rows, wall seconds and tokens."""
    import torch

    from rollout.engine import Engine

    K = config.block_size or model.config.block_size
    forwards = rows = 0
    tokens_ids = []
    step = max_batch if fixed else len(prompts)
    t0 = time.perf_counter()
    for s in range(0, len(prompts), step):
        chunk = range(s, min(s + step, len(prompts)))
        T = max(-(-(len(prompts[i]) + lengths[i]) // K) * K for i in chunk)
        engine = Engine(model, config, max_batch=min(max_batch, len(chunk)), canvas_len=T)
        for i in chunk:
            engine.submit(prompts[i], torch.Generator().manual_seed(seeds[i]), max_new_tokens=lengths[i])
        with torch.no_grad():
            done = engine.run()
        forwards, rows = forwards + engine.num_forwards, rows + engine.row_forwards
        tokens_ids += [q.canvas[q.prompt_len:q.prompt_len + q.max_new] for q in done]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(lengths), "forwards": forwards, "row_forwards": rows,
            "tokens_ids": tokens_ids}


def rl_workload_rows(model, config, *, n_prompts: int = 8, group: int = 8, max_batch: int = 16, short: int = 32,
                     tail_every: int = 8, tail_factor: int = 4, repeats: int = 2, seed: int = 0,
                     prompt_len: int = 16) -> dict:
    """Both schedules, alternated `repeats` times; returns the per-schedule figures and the ratios."""
    prompts, seeds, lengths = workload(n_prompts, group, short, tail_every, tail_factor, seed,
                                       model.config.vocab_size, prompt_len)
    config = config.replace(temperature=1.0, stop_at_eos=False, max_batch=max_batch)
    runs: dict[str, list[dict]] = {"fixed": [], "engine": []}
    for name in ("fixed", "engine"):  # untimed warm-up: first calls pay one-time allocation and dispatch costs
        _decode(model, prompts[:max_batch], seeds[:max_batch], lengths[:max_batch], config, max_batch, name == "fixed")
    for _ in range(repeats):
        for name in ("fixed", "engine"):
            runs[name].append(_decode(model, prompts, seeds, lengths, config, max_batch, name == "fixed"))
    out = {"workload": {"sequences": len(prompts), "prompts": n_prompts, "group": group, "max_batch": max_batch,
                        "short_tokens": short, "long_tokens": short * tail_factor,
                        "long_sequences": sum(m > short for m in lengths), "temperature": 1.0},
           "schedules": {}}
    for name, rs in runs.items():
        wall = sum(r["wall_s"] for r in rs)
        tokens = sum(r["tokens"] for r in rs)
        fw = rs[0]["forwards"]
        out["schedules"][name] = {"forwards": fw, "forwards_per_1k_tokens": 1000 * fw / rs[0]["tokens"],
                                  "mean_rows_per_forward": rs[0]["row_forwards"] / max(fw, 1),
                                  "tokens_per_s": tokens / wall, "wall_s_per_run": wall / len(rs),
                                  "wall_s_runs": [r["wall_s"] for r in rs]}
    f, e = out["schedules"]["fixed"], out["schedules"]["engine"]
    out["token_matches"] = sum(a == b for a, b in zip(runs["fixed"][0]["tokens_ids"], runs["engine"][0]["tokens_ids"]))
    out["ratios"] = {"forwards_fixed_over_engine": f["forwards_per_1k_tokens"] / e["forwards_per_1k_tokens"],
                     "tokens_per_s_engine_over_fixed": e["tokens_per_s"] / f["tokens_per_s"],
                     # per alternation round: the engine's speed over the fixed run just before it (the spread)
                     "tokens_per_s_per_round": [a / b for a, b in zip(f["wall_s_runs"], e["wall_s_runs"])]}
    return out


def print_rl_table(result: dict, spec: str, preset: str) -> None:
    from rich.console import Console
    from rich.table import Table

    w = result["workload"]
    t = Table(title=f"ebpo bench decode --rl-workload ({spec}, {preset}, {w['sequences']} sequences = "
                    f"{w['prompts']} prompts x {w['group']}, max_batch {w['max_batch']}, {w['long_sequences']} of "
                    f"{w['long_tokens']} tokens, the rest {w['short_tokens']}, temperature 1)")
    for col in ("schedule", "forwards", "forwards / 1k tokens", "rows / forward", "CPU tokens/s"):
        t.add_column(col)
    for name, r in result["schedules"].items():
        t.add_row(name, str(r["forwards"]), f"{r['forwards_per_1k_tokens']:.1f}",
                  f"{r['mean_rows_per_forward']:.2f}", f"{r['tokens_per_s']:.1f}")
    Console().print(t)
    ra = result["ratios"]
    rounds = ", ".join(f"{x:.2f}" for x in ra["tokens_per_s_per_round"])
    Console().print(f"engine: {ra['forwards_fixed_over_engine']:.2f}x fewer forwards per 1k tokens, "
                    f"{ra['tokens_per_s_engine_over_fixed']:.2f}x the CPU tokens/s (per round {rounds}); "
                    f"identical tokens for "
                    f"{result['token_matches']}/{w['sequences']} sequences")
