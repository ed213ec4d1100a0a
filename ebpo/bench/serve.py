"""`ebpo bench serve`: requests/s of `ebpo serve` with 16 concurrent clients against one client at a time, or
(`--mixed`) of a mix of decoding settings against one setting.

    ebpo bench serve                                   # tiny-agent, 2 rounds of 64 requests, 16 clients, 48 tokens
    ebpo bench serve --requests 64 --json docs/bench/serve_cpu.json
    ebpo bench serve --mixed --json docs/bench/serve_mixed_cpu.json

`--mixed`: 16 clients send the same requests three times: all with the quality preset, all with the speed preset
(both at temperature 0.7), and as a mix of 4 temperatures (0.4, 0.7, 1.0, 1.3) x the 2 presets, request i taking
setting i mod 8. The server's one engine decodes every setting in the same forwards, so the mix should cost what
its settings cost alone: the figure is the mix's requests/s over the rate the two uniform runs predict for it
(half the requests at each preset's time per request). One engine per setting (the old "lanes") gave about
1/lanes of it. Each request carries a seed, so every run is reproducible.

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


MIX_TEMPERATURES = (0.4, 0.7, 1.0, 1.3)
MIX_PRESETS = ("quality", "speed")


def _ask(client, model: str, question: str, max_tokens: int, setting: dict | None = None):
    """One chat completion; setting: temperature / seed / mode of the request (default greedy, server preset)."""
    setting = dict(setting or {})
    temperature = setting.pop("temperature", 0)
    seed = setting.pop("seed", None)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=max_tokens, temperature=temperature, seed=seed,
                                       extra_body={"return_token_ids": True, **setting})
    return r.choices[0].model_extra["token_ids"], r.usage.completion_tokens


def mixed_settings(n: int, preset: str | None = None) -> list[dict]:
    """Per request i: the mix's setting i mod 8 (4 temperatures x 2 presets), or with `preset` that preset at
    temperature 0.7 for all; every request seeded with its index."""
    if preset is not None:
        return [{"temperature": 0.7, "mode": preset, "seed": i} for i in range(n)]
    mix = [(t, m) for m in MIX_PRESETS for t in MIX_TEMPERATURES]
    return [{"temperature": mix[i % len(mix)][0], "mode": mix[i % len(mix)][1], "seed": i} for i in range(n)]


def run_clients(client, model: str, questions: list[str], clients: int, max_tokens: int, driver,
                settings: list[dict] | None = None) -> dict:
    """Send every question with `clients` threads each sending one request at a time; wall time, tokens.
    settings: one per question (see `_ask`), default greedy with the server's preset."""
    f0 = driver.num_forwards
    t0 = time.perf_counter()
    sets = settings or [None] * len(questions)
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(lambda qs: _ask(client, model, qs[0], max_tokens, qs[1]), zip(questions, sets)))
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
    p.add_argument("--mixed", action="store_true",
                   help="a mix of 4 temperatures x 2 presets against one setting (module docstring)")
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
        if a.mixed:
            return _mixed(a, client, service, driver, questions, torch.get_num_threads())
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


def _mixed(a, client, service, driver, questions: list[str], threads: int) -> int:
    """The `--mixed` runs (module docstring): uniform quality, uniform speed, the mix; rounds alternated."""
    kinds = {"uniform quality": mixed_settings(len(questions), "quality"),
             "uniform speed": mixed_settings(len(questions), "speed"), "mixed": mixed_settings(len(questions))}
    rounds = [{k: run_clients(client, service.name, questions, a.clients, a.max_tokens, driver, sets)
               for k, sets in kinds.items()} for _ in range(a.rounds)]
    runs = {k: _total([r[k] for r in rounds]) for k in kinds}
    for r in runs.values():
        r.pop("ids")
    n = len(questions) * a.rounds
    # half the requests at each preset's measured time per request
    predicted_s = 0.5 * n / runs["uniform quality"]["requests_per_s"] + 0.5 * n / runs["uniform speed"]["requests_per_s"]
    res = {"bench": "serve-mixed", "model": a.model, "requests": n, "rounds": a.rounds, "clients": a.clients,
           "max_tokens": a.max_tokens, "torch_threads": threads, "machine": platform.machine(),
           "temperatures": list(MIX_TEMPERATURES), "presets": list(MIX_PRESETS), "runs": runs,
           "predicted_mixed_requests_per_s": n / predicted_s,
           "mixed_vs_uniform": runs["mixed"]["requests_per_s"] / (n / predicted_s),
           "engines": 1}
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ebpo serve, {a.model}, {n} requests of {a.max_tokens} tokens max, {a.clients} clients")
    for col in ("run", "wall s", "requests/s", "completion tokens", "engine forwards"):
        t.add_column(col)
    for k, r in runs.items():
        t.add_row(k, f"{r['wall_s']:.1f}", f"{r['requests_per_s']:.2f}", str(r["completion_tokens"]), str(r["forwards"]))
    Console().print(t)
    print(f"mixed settings: {res['mixed_vs_uniform']:.2f}x the requests/s of its settings run uniformly "
          f"({res['predicted_mixed_requests_per_s']:.2f} predicted), one engine")
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
