"""`ebpo bench agent`: multi-turn decoding throughput when sequences wait on slow tools, with and without the
ready sequences continuing past a waiting one (`rollout.multiturn`, `continue_ready`).

    ebpo bench agent                                    # 8 sequences, 3 turns, tools taking 0.2-0.6 s
    ebpo bench agent --batch 16 --latency 1.0 --json docs/bench/agent_cpu.json

The environment is scripted (`LatencyEnv`): every turn is answered after a wall-clock latency that differs
per sequence (sequence i waits `latency * (0.5 + (i % 3) / 2)` s), so tool time, not the model, decides
how long a sequence waits, and the comparison does not depend on what the model writes. Both modes decode
the same tokens (greedy; the test suite checks they are equal); only the wall time differs.
"""
from __future__ import annotations

import argparse
import json
import platform
import time


class LatencyEnv:
    """Answers each turn with `result <k>` after `latency_s`; done after `turns` turns."""

    def __init__(self, latency_s: float, turns: int):
        self.latency_s, self.turns, self.k = latency_s, turns, 0

    def reset(self, row, seed=None):
        self.k = 0
        return None

    def step(self, text: str):
        self.k += 1
        time.sleep(self.latency_s)
        return (f"result {self.k}", 0.0, self.k >= self.turns,
                {"tool_calls": [{"name": "slow", "ok": True, "latency_s": self.latency_s}]})


def run_once(model, tok, prompts, latency: float, turns: int, continue_ready: bool, turn_tokens: int) -> dict:
    from rollout.config import DecodeConfig
    from rollout.multiturn import MultiTurnConfig, generate_multiturn
    from rollout.trajectory import summarize

    envs = [LatencyEnv(latency * (0.5 + (i % 3) / 2), turns) for i in range(len(prompts))]
    mt = MultiTurnConfig(max_turns=turns, max_turn_tokens=turn_tokens, max_total_tokens=1024,
                         continue_ready=continue_ready, step_timeout_s=60.0)
    cfg = DecodeConfig.preset("quality", mbe_window=0)
    t0 = time.perf_counter()
    trajs = generate_multiturn(model, prompts, envs, cfg, mt, tokenizer=tok)
    wall = time.perf_counter() - t0
    tokens = sum(t.num_generated for t in trajs)
    m = summarize(trajs)
    return {"continue_ready": continue_ready, "wall_s": wall, "generated_tokens": tokens, "tokens_per_s": tokens / wall,
            "forwards": sum(t.num_forwards for t in trajs), "turns": m["agent/turns"],
            "env_latency_s_total": sum(t.metrics()["env_latency_s"] for t in trajs),
            "ids": [t.ids for t in trajs]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-sft", help="model folder or name (default: tiny-sft)")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--turns", type=int, default=3, help="model turns per sequence (each followed by a tool call)")
    p.add_argument("--latency", type=float, default=0.4, help="mean tool latency in seconds")
    p.add_argument("--turn-tokens", type=int, default=32, help="max tokens per turn")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    import torch

    from ebpo.infra.data import encode_prompt
    from ebpo.model.loading import load_model, load_model_tokenizer

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model).eval(), load_model_tokenizer(a.model)
    qs = [f"Compute {10 + 7 * i}+{20 + 3 * i}." for i in range(a.batch)]
    prompts = [encode_prompt(tok, q) for q in qs]
    run_once(model, tok, prompts[:2], 0.0, 1, True, 8)  # warm-up
    rows = [run_once(model, tok, prompts, a.latency, a.turns, cr, a.turn_tokens) for cr in (False, True)]
    same = rows[0].pop("ids") == rows[1].pop("ids")
    res = {"bench": "agent", "model": a.model, "batch": a.batch, "turns": a.turns, "latency_s": a.latency,
           "turn_tokens": a.turn_tokens, "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
           "same_tokens": same, "runs": rows, "speedup": rows[0]["wall_s"] / rows[1]["wall_s"]}
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"multi-turn decoding, {a.batch} sequences x {a.turns} turns, tools {a.latency:g} s mean")
    for col in ("ready sequences continue", "wall s", "generated tokens", "tokens/s", "forwards", "tool time s (sum)"):
        t.add_column(col)
    for r in rows:
        t.add_row("yes" if r["continue_ready"] else "no (batch waits)", f"{r['wall_s']:.2f}", str(r["generated_tokens"]),
                  f"{r['tokens_per_s']:.1f}", str(r["forwards"]), f"{r['env_latency_s_total']:.1f}")
    Console().print(t)
    print(f"throughput gain {res['speedup']:.2f}x; identical tokens: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
