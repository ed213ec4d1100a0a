"""`ebpo eval`: held-out accuracy and tokens per forward of a model, per decode preset.

    ebpo eval --model tiny-sft --data examples/data/math_eval.jsonl examples/data/code_eval.jsonl \\
        --presets quality speed speed_noedit --max-new-tokens 40 --json eval.json

--model takes a folder (save_pretrained layout, e.g. RUN_DIR/checkpoints/step_N/model), `tiny-sft`
(the shipped checkpoint) or `preset:NAME[@seed]`.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str]) -> int:
    from ebpo.sft.evaluation import PRESETS

    ap = argparse.ArgumentParser(prog="ebpo eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-sft", help="folder, tiny-sft, or preset:NAME[@seed]")
    ap.add_argument("--data", nargs="+", default=["examples/data/math_eval.jsonl", "examples/data/code_eval.jsonl"],
                    help=".jsonl/.json/.parquet/hf:PATH files of held-out rows (answer or tests)")
    ap.add_argument("--presets", nargs="+", default=["quality", "speed", "speed_noedit"], choices=sorted(PRESETS))
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--decode", default="{}", help='extra DecodeConfig fields as JSON, e.g. \'{"block_size": 8}\'')
    ap.add_argument("--limit", type=int, default=0, help="rows per data file (0 = all)")
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--samples", type=int, default=0, help="print this many sample completions per preset")
    ap.add_argument("--block-routing", type=int, default=None, metavar="C",
                    help="decode with block routing capacity C (0 = off; default: the model's config), and report "
                         "the distinct routed experts per block and forward (docs/background.md section 9)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--env", default=None, help="multi-turn: an environment (built-in name, module:name or "
                    "file.py:name); reports held-out success of multi-turn rollouts (ebpo/sft/agent_eval.py)")
    ap.add_argument("--env-kwargs", default="{}", help="JSON keyword arguments of the environment factory")
    ap.add_argument("--multiturn", default="{}", help='MultiTurnConfig fields as JSON, e.g. \'{"max_turns": 3}\'')
    args = ap.parse_args(argv)
    if args.env:
        return _agent(args)

    import torch
    from rich.console import Console
    from rich.table import Table

    from ebpo.infra.data import DataError, load_rows
    from ebpo.sft.evaluation import evaluate_rows
    from ebpo.model.loading import load_model, load_model_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rows = []
        for src in args.data:
            part = load_rows(src)
            rows += part[: args.limit] if args.limit else part
        decode = {"max_new_tokens": args.max_new_tokens, **json.loads(args.decode)}
    except (DataError, json.JSONDecodeError) as e:
        print(f"ebpo eval: {e}", file=sys.stderr)
        return 2
    model = load_model(args.model).eval()
    tokenizer = load_model_tokenizer(args.model)
    if args.block_routing is not None:
        from ebpo.model.routing import set_block_routing

        set_block_routing(model, args.block_routing)
    console = Console()
    results = {}
    for preset in args.presets:
        with _routing_stats(model, args.block_routing is not None) as rec:
            res = evaluate_rows(model, tokenizer, rows, preset=preset, decode=decode, batch_size=args.batch_size,
                                chat_template=not args.no_chat_template, keep_samples=args.samples)
        results[preset] = {"accuracy": res.accuracy, "task_accuracy": res.task_accuracy(), "tpf": res.tpf,
                           "forwards_per_seq": res.forwards / len(rows), "edits_per_seq": res.edits / len(rows),
                           "wall_s": res.wall_s, "rows": len(rows), "samples": res.samples,
                           "edits": {k.split("/", 1)[1]: v for k, v in res.metrics("/").items()
                                     if k.endswith(("edit_precision", "fixes_per_seq", "breaks_per_seq"))}}
        if rec is not None:
            per_block = rec.experts_per_block(decode.get("block_size") or model.config.block_size,
                                              model.config.num_experts).float()
            results[preset]["block_routing_capacity"] = model.config.block_routing_capacity
            results[preset]["experts_per_block"] = {"mean": float(per_block.mean()), "max": int(per_block.max())}
            console.print(f"[{preset}] routed experts per block and forward: mean {per_block.mean():.2f}, max "
                          f"{int(per_block.max())} of {model.config.num_experts} (block routing capacity "
                          f"{model.config.block_routing_capacity or 'off'})")
        for s in res.samples:
            console.print(f"[{preset}] {s['prompt']!r} -> {s['completion']!r} correct={s['correct']}")
    tasks = sorted({t for r in results.values() for t in r["task_accuracy"]})
    table = Table(title=f"{args.model}: held-out accuracy ({len(rows)} rows, greedy)")
    for col in ["preset", *[f"{t} acc" for t in tasks], "all acc", "TPF", "edits/seq", "edit prec.", "s"]:
        table.add_column(col, justify="right")
    for preset, r in results.items():
        table.add_row(preset, *[f"{r['task_accuracy'].get(t, float('nan')):.3f}" for t in tasks],
                      f"{r['accuracy']:.3f}", f"{r['tpf']:.2f}", f"{r['edits_per_seq']:.2f}",
                      " ".join(f"{k.split('/')[0]} {v:.2f}" for k, v in r["edits"].items() if k.endswith("precision")),
                      f"{r['wall_s']:.1f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "data": args.data, "decode": decode, "results": results}, f, indent=1)
    return 0


def _routing_stats(model, on: bool):
    """A `RoutingRecorder` on `model` when `on`, else a context that yields None."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    from ebpo.model.routing import RoutingRecorder

    return RoutingRecorder(model)


def _agent(args) -> int:
    """`ebpo eval --env ...`: held-out success of multi-turn rollouts, with `--samples` trajectories shown."""
    import torch
    from rich.console import Console

    from ebpo.infra.data import load_rows
    from ebpo.model.loading import load_model, load_model_tokenizer
    from ebpo.sft.agent_eval import evaluate_agent

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for src in args.data:
        part = load_rows(src)
        rows += part[: args.limit] if args.limit else part
    model, tok = load_model(args.model).eval(), load_model_tokenizer(args.model)
    res = evaluate_agent(model, tok, rows, env=args.env, env_kwargs=json.loads(args.env_kwargs),
                         decode=json.loads(args.decode), multiturn=json.loads(args.multiturn),
                         batch_size=args.batch_size, keep_samples=args.samples)
    console = Console()
    if res.samples:
        from rollout.show import render_trajectory

        for s in res.samples:
            console.print(render_trajectory(s, tok))
    console.print(f"{args.model}: held-out success {res.success:.3f} over {res.rows} rows ({res.wall_s:.1f} s); "
                  + ", ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in res.metrics.items()
                              if not k.startswith("agent/stop/")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "data": args.data, "env": args.env, "success": res.success,
                       "rows": res.rows, "metrics": res.metrics}, f, indent=1)
    return 0
