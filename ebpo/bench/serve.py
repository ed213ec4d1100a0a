"""`ebpo bench serve`: requests/s of `ebpo serve` with 16 concurrent clients against one client at a time.

    ebpo bench serve                                   # tiny-agent, 2 rounds of 64 requests, 16 clients, 48 tokens
    ebpo bench serve --requests 64 --json docs/bench/serve_cpu.json

The server runs in this process (uvicorn in a thread, the real `openai` client over HTTP on localhost). Both
runs send the same requests (different questions, greedy, `max_tokens` fixed), so they decode the same tokens
(checked: every request's token ids are compared); only the number of requests in flight differs. With one
client at a time every forward holds one row; with 16 clients the engine driver batches up to 16 rows per
forward (continuous batching), which is where the requests/s ratio comes from.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import time


def _ask(client, model: str, question: str, max_tokens: int):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.usage.completion_tokens


def run_clients(client, model: str, questions: list[str], clients: int, max_tokens: int, driver) -> dict:
    """Send every question with `clients` threads each sending one request at a time; wall time, tokens."""
    f0 = driver.num_forwards
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(lambda q: _ask(client, model, q, max_tokens), questions))
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in out)
    return {"clients": clients, "requests": len(questions), "wall_s": wall, "requests_per_s": len(questions) / wall,
            "completion_tokens": tokens, "tokens_per_s": tokens / wall, "forwards": driver.num_forwards - f0,
            "ids": [ids for ids, _ in out]}


def _total(runs: list[dict]) -> dict:
    """Rounds of one run added up (rates recomputed from the sums; ids concatenated)."""
    out = {"clients": runs[0]["clients"], "ids": [x for r in runs for x in r["ids"]]}
    for key in ("requests", "wall_s", "completion_tokens", "forwards"):
        out[key] = sum(r[key] for r in runs)
    out["requests_per_s"] = out["requests"] / out["wall_s"]
    out["tokens_per_s"] = out["completion_tokens"] / out["wall_s"]
    out["wall_s_per_round"] = [r["wall_s"] for r in runs]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-agent")
    p.add_argument("--requests", type=int, default=64, help="requests per run (both runs send the same ones)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the batched run")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--mode", default="quality", help="decoding preset of the server")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine (default 1: on a shared machine torch's pool of one thread per "
                        "core fights the other processes and every forward waits on it; 0: torch's default)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both runs, added up")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    import torch
    from openai import OpenAI

    from ebpo.serve.app import BackgroundServer, create_app
    from ebpo.serve.cli import build_service

    if a.threads:
        torch.set_num_threads(a.threads)
    service, driver = build_service(a.model, mode=a.mode, max_batch=a.clients, max_len=256 + a.max_tokens)
    live = BackgroundServer(create_app(service))
    client = OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=600)
    questions = [f"Compute {101 + 37 * i}*{12 + i % 29}." for i in range(a.requests)]
    try:
        run_clients(client, service.name, questions[:2], 2, 8, driver)  # warm-up
        rounds = [[run_clients(client, service.name, questions, c, a.max_tokens, driver) for c in (1, a.clients)]
                  for _ in range(a.rounds)]  # alternated, so that a change of the machine's load hits both
        runs = [_total([r[i] for r in rounds]) for i in (0, 1)]
    finally:
        live.stop()
        driver.close()
    same = runs[0].pop("ids") == runs[1].pop("ids")
    res = {"bench": "serve", "model": a.model, "mode": a.mode, "requests": a.requests * a.rounds,
           "rounds": a.rounds, "max_tokens": a.max_tokens,
           "torch_threads": torch.get_num_threads(), "machine": platform.machine(), "same_tokens": same,
           "runs": runs, "requests_per_s_ratio": runs[1]["requests_per_s"] / runs[0]["requests_per_s"]}
    _print(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ebpo serve, {res['model']}, {res['requests']} requests of {res['max_tokens']} tokens max "
                    f"({res['mode']}, greedy)")
    for col in ("clients", "wall s", "requests/s", "completion tokens", "tokens/s", "engine forwards"):
        t.add_column(col)
    for r in res["runs"]:
        t.add_row(str(r["clients"]), f"{r['wall_s']:.1f}", f"{r['requests_per_s']:.2f}", str(r["completion_tokens"]),
                  f"{r['tokens_per_s']:.1f}", str(r["forwards"]))
    Console().print(t)
    print(f"requests/s ratio {res['requests_per_s_ratio']:.2f}x; identical tokens: {res['same_tokens']}")
