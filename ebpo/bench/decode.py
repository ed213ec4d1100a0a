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


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def resolve_dtype(name: str, device: str):
    """The torch dtype of a bench's `--dtype`: fp32, bf16, fp16, or auto (bf16 on CUDA, fp32 elsewhere)."""
    import torch

    if name == "auto":
        name = "bf16" if str(device).startswith("cuda") else "fp32"
    if name not in DTYPES:
        raise ValueError(f"--dtype: got {name!r}; allowed: auto, {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name])


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
    _LAST_TOKENS[:] = [o.token_ids for o in outs]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "tpf": tokens / max(forwards, 1),
            "forwards_per_seq": forwards / len(outs), "edits_per_seq": sum(o.num_edits for o in outs) / len(outs)}


_LAST_TOKENS: list[list[int]] = []  # the token ids of the latest `_run`, for the token-match check


def vs_released(model, prompts, config, seeds, preset: str, batch: int, compiled: bool, chunk: int = 8) -> dict:
    """Our decoder against the released-style loop (`ebpo.bench.released`: one prompt at a time, no cache,
    full forward and logits every iteration), interleaved so that a change in the machine's load hits
    every contender alike: prompt by prompt, the released-style loop, our batch-1 decode (and the compiled
    step's), and after every `chunk` prompts one decode of all prompts as one batch (and compiled).
    Ratios: released seconds over ours, in total and per chunk of prompts (median, min, max). Compile
    time is excluded (each compiled shape is compiled by an untimed decode first) and reported."""
    import statistics

    import torch

    from ebpo.bench.released import released_style_generate
    from rollout import generate
    from rollout.compiled import canvas_length

    n = len(prompts)
    M = config.max_new_tokens
    K = config.block_size or model.config.block_size
    comp = config.replace(compiled_step=True)
    compile_s = 0.0
    if compiled:
        t0 = time.perf_counter()
        shapes = {}
        for i, p in enumerate(prompts):
            shapes.setdefault(canvas_length([len(p)], M, K), i)
        for i in shapes.values():
            generate(model, prompts[i:i + 1], comp, seeds=seeds[i:i + 1])
        generate(model, prompts[:batch], comp, seeds=seeds[:batch])
        compile_s = time.perf_counter() - t0

    def gen(cfg, s, e):
        t0 = time.perf_counter()
        outs = generate(model, prompts[s:e], cfg, seeds=seeds[s:e])
        return time.perf_counter() - t0, [o.token_ids for o in outs]

    names = ["released", "batch1"] + (["compiled_batch1"] if compiled else [])
    per_prompt = {k: [0.0] * n for k in names}
    tokens = {k: [None] * n for k in names}
    batched = {"batch": [], "compiled_batch": []}
    batched_tokens = {}
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        gen_ = torch.Generator().manual_seed(int(seeds[i])) if config.temperature > 0 else None
        tokens["released"][i] = released_style_generate(model, p, config, gen_)
        per_prompt["released"][i] = time.perf_counter() - t0
        per_prompt["batch1"][i], (tokens["batch1"][i],) = gen(config, i, i + 1)
        if compiled:
            per_prompt["compiled_batch1"][i], (tokens["compiled_batch1"][i],) = gen(comp, i, i + 1)
        if (i + 1) % chunk == 0 or i == n - 1:
            for key, cfg in (("batch", config), ("compiled_batch", comp)):
                if key == "compiled_batch" and not compiled:
                    continue
                times, toks = [], []
                for s in range(0, n, batch):
                    dt, tk = gen(cfg, s, s + batch)
                    times.append(dt)
                    toks += tk
                batched[key].append(sum(times))
                batched_tokens[key] = toks
    released_total = sum(per_prompt["released"])
    out = {"preset": preset, "prompts": n, "new_tokens": M, "batch": batch, "compile_s": compile_s,
           "released_tokens_per_s": n * M / released_total,
           "token_matches": {k: sum(a == b for a, b in zip(tokens[k], tokens["released"])) for k in names[1:]}}
    for k, toks in batched_tokens.items():
        out["token_matches"][k] = sum(a == b for a, b in zip(toks, tokens["released"]))
    chunks = [range(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    for k in names[1:]:
        total = sum(per_prompt[k])
        per_chunk = [sum(per_prompt["released"][i] for i in c) / sum(per_prompt[k][i] for i in c) for c in chunks]
        out[f"{k}_tokens_per_s"] = n * M / total
        out[f"{k}_over_released"] = released_total / total
        out[f"{k}_over_released_chunks"] = per_chunk
    for k, times in batched.items():
        if not times:
            continue
        # each batched decode covers all n prompts; compare it with the released-style time of the chunk
        # just before it, scaled to n prompts
        per_chunk = [sum(per_prompt["released"][i] for i in c) * n / len(c) / t for c, t in zip(chunks, times)]
        out[f"{k}{batch}_tokens_per_s"] = n * M / statistics.median(times)
        out[f"{k}{batch}_over_released"] = released_total / statistics.median(times)
        out[f"{k}{batch}_over_released_chunks"] = per_chunk
    for k in [x for x in out if x.endswith("_over_released")]:
        ch = out[k + "_chunks"]
        print(f"  {preset:8s} {k:32s} {out[k]:6.2f}x  (per chunk of {chunk} prompts: median "
              f"{statistics.median(ch):.2f}, {min(ch):.2f}-{max(ch):.2f})", flush=True)
    print(f"  {preset:8s} released-style loop {out['released_tokens_per_s']:.1f} tok/s; sequences with its tokens: "
          f"{out['token_matches']}", flush=True)
    return out


def _compiled_rows(model, prompts, config, seeds, preset: str, batches: list[int], eager_tokens=None) -> list[dict]:
    """Rows for `compiled_step=True`: each distinct compiled shape is compiled by an untimed warm-up decode
    first (its seconds are reported as compile_s), then the rows are timed like the eager ones;
    `token_matches` counts sequences with the eager batch-B row's tokens."""
    from rollout import generate
    from rollout.compiled import canvas_length

    cfg = config.replace(compiled_step=True)
    K = cfg.block_size or model.config.block_size
    out = []
    for batch in batches:
        shapes = {}
        for s in range(0, len(prompts), batch):
            chunk = prompts[s:s + batch]
            shapes.setdefault((len(chunk), canvas_length([len(p) for p in chunk], cfg.max_new_tokens, K)), s)
        t0 = time.perf_counter()
        for (n, _), s in shapes.items():
            generate(model, prompts[s:s + n], cfg, seeds=seeds[s:s + n])
        compile_s = time.perf_counter() - t0
        r = _run(model, prompts, cfg, seeds, batch)
        matches = sum(x == y for x, y in zip(_LAST_TOKENS, eager_tokens)) if eager_tokens else None
        out.append({"preset": preset, "batch": batch, "cache": True, "compiled": True, "compile_s": compile_s,
                    "compiled_shapes": len(shapes), "token_matches": matches, **r})
        print(f"  {preset:8s} batch {batch:3d} cache on  compiled: {r['tokens_per_s']:9.1f} tok/s  TPF {r['tpf']:.2f}"
              f"  (compile + warm-up {compile_s:.1f} s, {len(shapes)} shape(s))", flush=True)
    return out


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
    from rollout.config import parse_override

    a = _parser().parse_args(argv)
    overrides = dict(parse_override(item) for item in a.overrides)
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = a.model or ("tiny-sft" if (TINY_SFT_DIR / "config.json").exists() else "preset:tiny")
    dtype = resolve_dtype(a.dtype, a.device)
    model = load_model(spec, dtype=dtype, device=a.device).eval()
    V = model.config.vocab_size
    if a.prompts:
        prompts = prompt_ids_from_file(a.prompts, load_model_tokenizer(spec), a.batch)
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(8, V, (a.prompt_len,), generator=gen).tolist() for _ in range(a.batch)]
    seeds = list(range(a.batch))

    def cfg(preset, cache):
        return DecodeConfig.preset(preset, **{"max_new_tokens": a.new_tokens, "use_cache": cache, "stop_at_eos": False,
                                              "temperature": a.temperature, **overrides})

    _run(model, prompts[:2], cfg("m2t", True).replace(max_new_tokens=16), seeds[:2], 2)  # warm-up
    if a.block_routing is not None:
        return _block_routing_main(a, model, spec, prompts, seeds, cfg(a.presets.split(",")[0], True))
    if a.rl_workload:
        return _rl_workload_main(a, model, spec, cfg)
    rows, released = [], []
    for preset in a.presets.split(","):
        plan = [(1, True), (1, False), (a.batch, True)]
        if preset == a.off_batch_preset:
            plan.append((a.batch, False))
        if a.compiled_only or a.skip_rows:
            plan = []
        eager_tokens = None
        for batch, cache in plan:
            r = _run(model, prompts, cfg(preset, cache), seeds, batch)
            rows.append({"preset": preset, "batch": batch, "cache": cache, **r})
            if (batch, cache) == (a.batch, True):
                eager_tokens = list(_LAST_TOKENS)
            print(f"  {preset:8s} batch {batch:3d} cache {'on ' if cache else 'off'}: "
                  f"{r['tokens_per_s']:9.1f} tok/s  TPF {r['tpf']:.2f}", flush=True)
        if (a.compiled or a.compiled_only) and not a.skip_rows:
            rows += _compiled_rows(model, prompts, cfg(preset, True), seeds, preset, [1, a.batch], eager_tokens)
        if a.vs_released:
            released.append(vs_released(model, prompts, cfg(preset, True), seeds, preset, a.batch,
                                        a.compiled or a.compiled_only))

    def find(preset, batch, cache, compiled=False):
        return next((r for r in rows if (r["preset"], r["batch"], r["cache"], r.get("compiled", False)) ==
                     (preset, batch, cache, compiled)), None)

    ratios = {}
    for preset in a.presets.split(","):
        if a.compiled_only or a.skip_rows:
            continue
        on1, off1, onB, offB = (find(preset, 1, True), find(preset, 1, False), find(preset, a.batch, True),
                                find(preset, a.batch, False))
        ratios[preset] = {"cache_speedup_batch1": on1["tokens_per_s"] / off1["tokens_per_s"],
                          f"batch{a.batch}_over_batch1": onB["tokens_per_s"] / on1["tokens_per_s"]}
        if offB:
            ratios[preset][f"cache_speedup_batch{a.batch}"] = onB["tokens_per_s"] / offB["tokens_per_s"]
        for batch in (1, a.batch):
            comp = find(preset, batch, True, True)
            eager = find(preset, batch, True)
            if comp:
                ratios[preset][f"compiled_over_eager_batch{batch}"] = comp["tokens_per_s"] / eager["tokens_per_s"]
    result = {"machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "device": a.device,
                          "python": platform.python_version(), "torch": torch.__version__},
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
              "model": spec, "new_tokens": a.new_tokens, "overrides": overrides, "load_avg": list(os.getloadavg()),
              "prompts": a.prompts or f"random, {a.prompt_len} tokens",
              "rows": rows, "ratios": ratios, "vs_released": released}

    from rich.console import Console
    from rich.table import Table

    source = f"prompts {Path(a.prompts).name}" if a.prompts else "random prompts"
    t = Table(title=f"ebpo bench decode ({spec}, {source}, {a.new_tokens} new tokens, {a.device}, "
                    f"{str(dtype).removeprefix('torch.')})")
    for col in ("preset", "batch", "cache", "tokens/s", "TPF", "forwards/seq", "edits/seq", "wall s"):
        t.add_column(col)
    for r in rows:
        label = r["preset"] + (" compiled" if r.get("compiled") else "")
        t.add_row(label, str(r["batch"]),
                  "on" if r["cache"] else "off", f"{r['tokens_per_s']:.1f}",
                  f"{r['tpf']:.2f}", f"{r['forwards_per_seq']:.1f}", f"{r['edits_per_seq']:.1f}", f"{r['wall_s']:.2f}")
    Console().print(t)
    for preset, rr in ratios.items():
        Console().print(f"{preset}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in rr.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _block_routing_main(a, model, spec, prompts, seeds, config) -> int:
    """`--block-routing`: the capacity comparison of `ebpo.bench.decode_routing`, printed and written as JSON."""
    import torch

    from ebpo.bench.decode_routing import block_routing_rows, print_table

    caps = [int(c) for c in a.block_routing.split(",")]
    rows = block_routing_rows(model, prompts, config, seeds, a.batch, caps)
    c = model.config
    print_table(rows, spec, c.num_experts, c.num_experts_per_tok, config.block_size or c.block_size)
    if a.json:
        result = {"machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "device": a.device,
                              "torch": torch.__version__}, "model": spec, "decode_preset": a.presets.split(",")[0],
                  "new_tokens": a.new_tokens, "load_avg": list(os.getloadavg()),
                  "prompts": a.prompts or f"random, {a.prompt_len} tokens", "block_routing": rows}
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _rl_workload_main(a, model, spec, cfg) -> int:
    """`--rl-workload`: fixed batches against the engine for every preset (`ebpo.bench.decode_rl`)."""
    import torch

    from ebpo.bench.decode_rl import print_rl_table, rl_workload_rows

    results = {}
    for preset in a.presets.split(","):
        results[preset] = rl_workload_rows(model, cfg(preset, True), n_prompts=a.rl_prompts, group=a.rl_group,
                                           max_batch=a.max_batch, short=a.rl_short, repeats=a.repeats,
                                           prompt_len=a.prompt_len)
        print_rl_table(results[preset], spec, preset)
    if a.json:
        out = {"machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "device": a.device,
                           "torch": torch.__version__}, "model": spec, "load_avg": list(os.getloadavg()),
               "rl_workload": results}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _parser():
    """The command line of `ebpo bench decode`."""
    import torch

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
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights and activations: auto = bf16 on CUDA, fp32 elsewhere (default: %(default)s)")
    p.add_argument("--compiled", action="store_true",
                   help="also time compiled_step=true at batch 1 and batch B, cache on (compile time excluded, reported)")
    p.add_argument("--compiled-only", action="store_true", help="only the compiled rows (no eager rows or ratios)")
    p.add_argument("--skip-rows", action="store_true", help="no table rows (with --vs-released: only that comparison)")
    p.add_argument("--vs-released", action="store_true",
                   help="also compare with a released-style loop (one prompt at a time, no cache, full logits; same "
                        "tokens), interleaved prompt by prompt with our batch-1 decode and, every 8 prompts, batch B")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DecodeConfig field in every row, e.g. --set compiled_step=true (repeatable)")
    p.add_argument("--block-routing", default=None, metavar="C,C,...",
                   help="instead of the usual rows: decode at these block-routing capacities (0 = off, e.g. 0,12) "
                        "with the first of --presets, batch 1 and --batch, and print tokens/s and experts per block")
    p.add_argument("--rl-workload", action="store_true",
                   help="instead of the usual rows: an RL-like workload (G samples per prompt at temperature 1, one "
                        "in eight 4x longer, more sequences than --max-batch) decoded by fixed batches and by the "
                        "continuous-batching engine; forwards per 1k tokens, rows per forward, CPU tokens/s")
    p.add_argument("--rl-prompts", type=int, default=16, help="--rl-workload: prompts")
    p.add_argument("--rl-group", type=int, default=8, help="--rl-workload: samples per prompt")
    p.add_argument("--rl-short", type=int, default=32, help="--rl-workload: new tokens of a short answer")
    p.add_argument("--max-batch", type=int, default=16, help="--rl-workload: rows per forward at most")
    p.add_argument("--repeats", type=int, default=2, help="--rl-workload: alternated runs of each schedule")
    p.add_argument("--json", default=None)
    return p
