"""`ebpo bench decode`: draft-and-edit decoding throughput (tokens/s) and tokens per forward (TPF).

For each preset: batch 1 with the prefix KV cache on and off, and batch B (default 32) with the cache
on; plus batch B with the cache off for one preset (the slow one: it recomputes the prefix). Every row
decodes the same B prompts: batch 1 decodes them one at a time (until 2026-11-23 it decoded only the
first prompt, so the batch-1 figure depended on that one prompt). Every
sequence decodes exactly --new-tokens tokens (EOS stop off) so the rows are comparable. Prints a table
and writes JSON with --json PATH. Targets (CPU, tiny model, 256 new tokens): cache on >= 3x cache off,
batch 32 >= 8x the tokens/s of batch 1.

Prompts are random token ids by default (--prompt-len tokens each). `--prompts FILE.jsonl` takes the
first B rows' `prompt` field instead, chat-templated as in training and evaluation: the in-distribution
case, where a trained model answers, writes EOS and then fills the rest of the canvas with confident
EOS tokens, instead of rewriting what it wrote after a prompt it cannot read.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def _run(model, prompts, config, seeds, batch: int) -> dict:
    """Decode `prompts` in consecutive batches of `batch` (1 = each prompt alone) and time the whole lot,
    so every row of the table decodes the same prompts and differs only in how they are batched."""
    from rollout import generate

    outs, wall = [], 0.0
    for s in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        outs += generate(model, prompts[s:s + batch], config, seeds=seeds[s:s + batch])
        wall += time.perf_counter() - t0
    # Decoded positions, not the text up to the first EOS: with EOS stop off every sequence decodes
    # max_new_tokens positions, and a trained model on random prompts writes EOS early.
    tokens = len(outs) * config.max_new_tokens
    forwards = sum(o.num_forwards for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "tpf": tokens / max(forwards, 1),
            "forwards_per_seq": forwards / len(outs), "edits_per_seq": sum(o.num_edits for o in outs) / len(outs)}


def prompt_ids_from_file(path: str, tokenizer, n: int) -> list[list[int]]:
    """Token ids of the first `n` rows' `prompt` in a data file (`ebpo.infra.data.load_rows`: JSONL, JSON, Parquet),
    chat-templated as in evaluation. A bad row names its file and line; fewer than `n` rows is an error
    too (the batch rows would not be comparable)."""
    from ebpo.infra.data import encode_prompt, load_rows

    rows = load_rows(path, required=("prompt",))
    if len(rows) < n:
        raise ValueError(f"{path}: {len(rows)} prompts, the batch needs {n}")
    return [encode_prompt(tokenizer, row["prompt"], True) for row in rows[:n]]


def main(argv: list[str]) -> int:
    import torch

    from ebpo.model.loading import TINY_SFT_DIR, load_model, load_model_tokenizer
    from rollout import DecodeConfig

    p = argparse.ArgumentParser(prog="ebpo bench decode")
    p.add_argument("--model", default=None, help="default: the shipped tiny-sft checkpoint, else preset:tiny")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16, help="random prompts: tokens per prompt")
    p.add_argument("--prompts", default=None,
                   help="JSONL file: use the first --batch rows' `prompt` (chat template) instead of random ids")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--presets", default="quality,speed,m2t")
    p.add_argument("--off-batch-preset", default="m2t", help="preset for the batch-B cache-off row ('' = skip)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = a.model or ("tiny-sft" if (TINY_SFT_DIR / "config.json").exists() else "preset:tiny")
    model = load_model(spec, device=a.device).eval()
    V = model.config.vocab_size
    if a.prompts:
        prompts = prompt_ids_from_file(a.prompts, load_model_tokenizer(spec), a.batch)
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(8, V, (a.prompt_len,), generator=gen).tolist() for _ in range(a.batch)]
    seeds = list(range(a.batch))

    def cfg(preset, cache):
        return DecodeConfig.preset(preset, max_new_tokens=a.new_tokens, use_cache=cache, stop_at_eos=False,
                                   temperature=a.temperature)

    _run(model, prompts[:2], cfg("m2t", True).replace(max_new_tokens=16), seeds[:2], 2)  # warm-up
    rows = []
    for preset in a.presets.split(","):
        plan = [(1, True), (1, False), (a.batch, True)]
        if preset == a.off_batch_preset:
            plan.append((a.batch, False))
        for batch, cache in plan:
            r = _run(model, prompts, cfg(preset, cache), seeds, batch)
            rows.append({"preset": preset, "batch": batch, "cache": cache, **r})
            print(f"  {preset:8s} batch {batch:3d} cache {'on ' if cache else 'off'}: "
                  f"{r['tokens_per_s']:9.1f} tok/s  TPF {r['tpf']:.2f}", flush=True)

    def find(preset, batch, cache):
        return next((r for r in rows if (r["preset"], r["batch"], r["cache"]) == (preset, batch, cache)), None)

    ratios = {}
    for preset in a.presets.split(","):
        on1, off1, onB, offB = (find(preset, 1, True), find(preset, 1, False), find(preset, a.batch, True),
                                find(preset, a.batch, False))
        ratios[preset] = {"cache_speedup_batch1": on1["tokens_per_s"] / off1["tokens_per_s"],
                          f"batch{a.batch}_over_batch1": onB["tokens_per_s"] / on1["tokens_per_s"]}
        if offB:
            ratios[preset][f"cache_speedup_batch{a.batch}"] = onB["tokens_per_s"] / offB["tokens_per_s"]
    result = {"machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "device": a.device,
                          "python": platform.python_version(), "torch": torch.__version__},
              "model": spec, "new_tokens": a.new_tokens, "prompts": a.prompts or f"random, {a.prompt_len} tokens",
              "rows": rows, "ratios": ratios}

    from rich.console import Console
    from rich.table import Table

    source = f"prompts {Path(a.prompts).name}" if a.prompts else "random prompts"
    t = Table(title=f"ebpo bench decode ({spec}, {source}, {a.new_tokens} new tokens, {a.device})")
    for col in ("preset", "batch", "cache", "tokens/s", "TPF", "forwards/seq", "edits/seq", "wall s"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["preset"], str(r["batch"]), "on" if r["cache"] else "off", f"{r['tokens_per_s']:.1f}",
                  f"{r['tpf']:.2f}", f"{r['forwards_per_seq']:.1f}", f"{r['edits_per_seq']:.1f}", f"{r['wall_s']:.2f}")
    Console().print(t)
    for preset, rr in ratios.items():
        Console().print(f"{preset}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in rr.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
