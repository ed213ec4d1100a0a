"""`ebpo bench decode --block-routing 0,12`: decoding with and without LLaDA2.2 block routing.

For every capacity C (0 = per-token routing) the same prompts are decoded at batch 1 and batch B with the
prefix cache, timed without instrumentation, the capacities taking turns batch by batch; an untimed batch-1
decode under `ebpo.model.routing.RoutingRecorder` counts the distinct routed experts of every (forward, MoE layer, block).
The expert footprint column is what one block's forward reads of the routed experts' weights: distinct experts
per block x 3 projections x hidden x moe_intermediate x bytes per weight, per MoE layer.
"""
from __future__ import annotations

import time


def _decode(model, prompts, config, seeds) -> tuple[float, int]:
    """(wall seconds, forwards) of decoding `prompts` as one batch."""
    from rollout import generate

    t0 = time.perf_counter()
    outs = generate(model, prompts, config, seeds=seeds)
    return time.perf_counter() - t0, sum(o.num_forwards for o in outs)


def block_routing_rows(model, prompts, config, seeds, batch: int, capacities: list[int]) -> list[dict]:
    """One row per (capacity, batch): tokens/s, TPF, distinct experts per block (mean, max) and the routed
    expert weights one block's forward reads per MoE layer (MB). The capacities take turns batch by batch
    (interleaved), so that a change in the machine's load hits all of them alike. Leaves the model at its
    original capacity."""
    import torch

    from ebpo.model.routing import RoutingRecorder, set_block_routing

    cfg = model.config
    original = cfg.block_routing_capacity
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * next(model.parameters()).element_size()
    K = config.block_size or cfg.block_size
    rows = []
    try:
        per_block = {}
        for c in capacities:  # untimed, instrumented: batch 1, one prompt at a time
            set_block_routing(model, c)
            with RoutingRecorder(model) as rec, torch.no_grad():
                for i in range(len(prompts)):
                    _decode(model, prompts[i:i + 1], config, seeds[i:i + 1])
            per_block[c] = rec.experts_per_block(K, cfg.num_experts).float()
        for b in (1, batch):
            wall = dict.fromkeys(capacities, 0.0)
            forwards = dict.fromkeys(capacities, 0)
            for s in range(0, len(prompts), b):
                for c in capacities:
                    set_block_routing(model, c)
                    dt, n = _decode(model, prompts[s:s + b], config, seeds[s:s + b])
                    wall[c] += dt
                    forwards[c] += n
            tokens = len(prompts) * config.max_new_tokens
            for c in capacities:
                pb = per_block[c]
                rows.append({"capacity": c, "batch": b, "tokens_per_s": tokens / wall[c],
                             "tpf": tokens / max(forwards[c], 1), "wall_s": wall[c],
                             "experts_per_block_mean": float(pb.mean()), "experts_per_block_max": int(pb.max()),
                             "expert_mb_per_block_layer": float(pb.mean()) * per_expert / 1e6})
                r = rows[-1]
                print(f"  block routing C={c:<3d} batch {b:3d}: {r['tokens_per_s']:9.1f} tok/s  TPF {r['tpf']:.2f}  "
                      f"experts/block {r['experts_per_block_mean']:.1f} (max {r['experts_per_block_max']})", flush=True)
    finally:
        set_block_routing(model, original)
    return rows


def print_table(rows: list[dict], spec: str, num_experts: int, top_k: int, block_size: int) -> None:
    """The comparison as a rich table, with the speed ratio of each capacity over C = 0 at the same batch."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"block routing ({spec}: E={num_experts}, k={top_k}, block {block_size})")
    for col in ("C", "batch", "tokens/s", "vs C=0", "TPF", "experts/block", "max", "expert MB/block/layer"):
        t.add_column(col)
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["capacity"] == 0}
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
        t.add_row("off" if r["capacity"] == 0 else str(r["capacity"]), str(r["batch"]), f"{r['tokens_per_s']:.1f}",
                  f"{ratio:.2f}x", f"{r['tpf']:.2f}", f"{r['experts_per_block_mean']:.1f}",
                  str(r["experts_per_block_max"]), f"{r['expert_mb_per_block_layer']:.2f}")
    Console().print(t)
