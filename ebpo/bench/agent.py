"""`ebpo bench agent`: two side-by-side comparisons in one run, on tools that take real wall time.

1. multi-turn decoding throughput when sequences wait on slow tools, with and without the ready sequences
   continuing past a waiting one (`rollout.multiturn`, `continue_ready`);
2. wall time per RL step of the agent recipe at `trainer.max_staleness` 0 and 1 (`ebpo.bench.agent_rl`):
   asynchronous RL overlapping tool waits and decoding with learning.

    ebpo bench agent                                    # both; decoding: 8 sequences, 3 turns, tools 0.2-0.6 s
    ebpo bench agent --skip-rl --batch 16 --latency 1.0 # decoding only
    ebpo bench agent --skip-decode --rl-latency 4.0     # RL only, tools taking 4 s per call
    ebpo bench agent --json docs/bench/agent_cpu.json

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
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: leave as is for decoding; 1 per actor for RL, so that the rollout worker "
                        "and the learner of the asynchronous run do not oversubscribe 2 cores)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--skip-decode", action="store_true", help="leave out the decoding comparison")
    p.add_argument("--skip-rl", action="store_true", help="leave out the RL step comparison (max_staleness 0 vs 1)")
    p.add_argument("--rl-recipe", default="recipes/quickstart_agent.yaml", help="agent recipe of the RL comparison")
    p.add_argument("--rl-latency", type=float, default=8.0,
                   help="seconds every tool call takes in the RL comparison (default 8: the tools, not the 2 cores, "
                        "decide the rollout time)")
    p.add_argument("--rl-steps", type=int, default=5, help="RL steps per run (the first is left out)")
    p.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override of both RL runs (repeatable)")
    a = p.parse_args(argv)
    res = {"bench": "agent", "machine": platform.machine()}
    if not a.skip_decode:
        res["decode"] = _decode(a)
    if not a.skip_rl:
        from rich.console import Console

        from ebpo.bench.agent_rl import compare, table

        res["rl"] = compare(a.rl_recipe, a.rl_latency, a.rl_steps, a.threads or 1, a.rl_set)
        Console().print(table(res["rl"]))
        print(f"asynchronous RL (max_staleness 1) step speed-up: {res['rl']['speedup']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _decode(a) -> dict:
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
    return res
