"""`ebpo bench learner`: EBPO learner throughput, token-budget micro-batches and learner ranks.

A batch whose response lengths vary 8x (from L/8 to L, evenly spread) goes through `EBPOLearner.update`
(the clipped surrogate with gradient replay) in these configurations:
  padded    - W = 1, the whole minibatch right-padded to its longest row (today's default);
  budget    - W = 1, `max_tokens_per_microbatch` micro-batches of rows of similar length, trimmed of
              trailing padding blocks;
  (padded and budget run interleaved in one process, one update of each per round, and the ratio of each
  round's pair is reported: on a shared machine the load weighs on both alike)
  w2        - W = 2 ranks (gloo, two processes) at the same global batch, padded;
  w2_budget - W = 2 with the token budget.
Reported: train tokens/s (real prompt+response tokens of the batch per second of update, median over
rounds), peak RSS per rank (MiB, `ru_maxrss`) and the ratios budget/padded and w2/w1. On a 2-core machine
two ranks share the cores that one rank already uses: the W ratio says what the split costs, not what
a cluster gains.

`--precision` instead measures what bf16 does to the EBPO log-ratio: the sequence composites (mean over
draws) of the same weights and noise draws computed with the body in bf16 (the learner's `dtype=bf16`
path: autocast, fp32 head and sums) and in fp32, for responses of 256 and 2048 tokens; the rms difference
is the log-ratio error a bf16 learner sees at ratio 1 if old and current took different code paths.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from ebpo.core.likelihood import all_composites, draw_noise
from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.rl.learner import EBPOLearner, LearnerConfig, PolicyForward, autocast_call


def _batch(batch: int, length: int, vocab: int, eos: int, mask: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = 8
    lengths = [max(2, round(length / 8 + (length - length / 8) * i / max(batch - 1, 1))) for i in range(batch)]
    L = prompt + max(lengths)
    ids = torch.full((batch, L), eos, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(0, vocab, (prompt + n,), generator=g)
        ids[i, : prompt + n] = torch.where((row == eos) | (row == mask), (row + 1) % vocab, row)
        ids[i, prompt + n - 1] = eos
    return {"input_ids": ids, "prompt_lens": torch.full((batch,), prompt), "advantages": torch.randn(batch, generator=g),
            "real_tokens": prompt * batch + sum(lengths)}


def _model(args):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LLaDA2MoeModelLM(tiny_config(block_size=args.block_size, hidden_size=args.hidden,
                                            num_hidden_layers=args.layers))


def _run(rank: int, world: int, port: int, args, budget: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    model = _model(args)
    learner = EBPOLearner(model, LearnerConfig(num_workers=world, n_draws=args.n_draws, lr=1e-6, seed=0,
                                               max_tokens_per_microbatch=budget))
    c = model.config
    b = _batch(args.batch, args.length, c.vocab_size, c.eos_token_id, c.mask_token_id)
    real = b.pop("real_tokens")
    learner.update(b)  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        learner.update(b)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": times, "real_tokens": real,
                       "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _interleaved(rank: int, args, budget: int, out: str) -> None:
    """Padded and token-budget learners (same weights, same batch) in one process, one update of each per
    round, the order alternating; writes each round's seconds per configuration."""
    torch.set_num_threads(args.threads)
    learners = {name: EBPOLearner(_model(args), LearnerConfig(n_draws=args.n_draws, lr=1e-6, seed=0,
                                                              max_tokens_per_microbatch=b))
                for name, b in (("padded", 0), ("budget", budget))}
    c = learners["padded"].model_config
    b = _batch(args.batch, args.length, c.vocab_size, c.eos_token_id, c.mask_token_id)
    real = b.pop("real_tokens")
    for lrn in learners.values():
        lrn.update(b)  # warm-up
    seconds = {name: [] for name in learners}
    for r in range(args.repeats):
        for name in (("padded", "budget") if r % 2 == 0 else ("budget", "padded")):
            t0 = time.perf_counter()
            learners[name].update(b)
            seconds[name].append(time.perf_counter() - t0)
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "real_tokens": real,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)


def measure_interleaved(args, budget: int) -> tuple[dict, list[float]]:
    """Padded vs token budget at W = 1, interleaved round by round in one fresh process (on a shared
    machine the load then weighs on both alike). Returns ({config: result}, [budget/padded speed of each
    round's pair])."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.spawn(_interleaved, args=(args, budget, out), nprocs=1, join=True)
        with open(out) as f:
            r = json.load(f)
    results = {}
    for name, secs in r["seconds"].items():
        med = statistics.median(secs)
        results[name] = {"tokens_per_s": r["real_tokens"] / med, "seconds_median": med, "seconds_min": min(secs),
                         "seconds_max": max(secs), "peak_rss_mib": r["peak_rss_mib"]}
    pairs = [p / b for p, b in zip(r["seconds"]["padded"], r["seconds"]["budget"])]
    return results, pairs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, world: int, budget: int) -> dict:
    """One configuration in fresh processes: {"tokens_per_s", "seconds_median", "peak_rss_mib"}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.spawn(_run, args=(world, _free_port(), args, budget, out), nprocs=world, join=True)
        with open(out) as f:
            r = json.load(f)
    med = statistics.median(r["seconds"])
    return {"tokens_per_s": r["real_tokens"] / med, "seconds_median": med,
            "seconds_min": min(r["seconds"]), "seconds_max": max(r["seconds"]), "peak_rss_mib": r["peak_rss_mib"]}


def precision_error(args, lengths=(256, 2048), batch: int = 4) -> dict:
    """{length: rms over sequences of C_bf16 - C_fp32 (nats)} for responses of `length` tokens."""
    torch.set_num_threads(args.threads)
    model = _model(args).eval()
    c = model.config
    out = {}
    for n in lengths:
        b = _batch(batch, n, c.vocab_size, c.eos_token_id, c.mask_token_id)
        ids = b["input_ids"]
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[:, 8:] = ids[:, 8:] != c.eos_token_id
        noise = draw_noise(resp, args.block_size, args.n_draws, 0.1, 1.0, torch.Generator().manual_seed(0))
        with torch.no_grad():
            fp32 = all_composites(PolicyForward(model, model), ids, noise, c.mask_token_id, cached=True).mean(1)
            bf16 = all_composites(PolicyForward(autocast_call(model, "cpu"), model), ids, noise, c.mask_token_id,
                                  cached=True).mean(1)
        out[n] = float((bf16 - fp32).pow(2).mean().sqrt())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench learner", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16, help="sequences per update (one minibatch)")
    p.add_argument("--length", type=int, default=256, help="longest response; the shortest is length/8")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-draws", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--budget", type=int, default=0, help="tokens per micro-batch (0 = 4 x the longest row)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--skip-w2", action="store_true", help="only the single-rank configurations")
    p.add_argument("--precision", action="store_true", help="bf16 vs fp32 log-ratio error at 256 / 2048 tokens")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.precision:
        err = precision_error(args)
        for n, e in err.items():
            print(f"response {n:>5} tokens: rms |C_bf16 - C_fp32| = {e:.4f} nats (clip window ln 1.28 = 0.247)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": vars(args), "rms_nats": err}, f, indent=1)
        return 0
    budget = args.budget or 4 * (8 + args.length + args.block_size)
    results, pairs = measure_interleaved(args, budget)
    if not args.skip_w2:
        results.update(w2=measure(args, 2, 0), w2_budget=measure(args, 2, budget))
    ratios = {"budget_vs_padded": results["budget"]["tokens_per_s"] / results["padded"]["tokens_per_s"],
              # the median of same-round pairs: what `ebpo bench check` guards (robust to load drifting)
              "budget_vs_padded_paired": statistics.median(pairs)}
    if not args.skip_w2:
        ratios["w2_vs_w1"] = results["w2"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
        ratios["w2_budget_vs_w1_padded"] = results["w2_budget"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    print(f"{'config':<11} {'tokens/s':>10} {'s/update':>9} {'peak MiB/rank':>14}")
    for name, r in results.items():
        print(f"{name:<11} {r['tokens_per_s']:>10.0f} {r['seconds_median']:>9.3f} {r['peak_rss_mib']:>14.0f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print("same-round pairs, budget/padded: " + " ".join(f"{x:.2f}" for x in pairs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args) | {"budget": budget}, "results": results, "ratios": ratios,
                       "pairs": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
