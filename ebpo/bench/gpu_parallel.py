"""The tensor-parallel row of `ebpo bench gpu` (its `tensor_parallel` section): a 2-rank `ParallelRolloutWorker`
against the one-process `RolloutWorker` on the same random-weight preset, prompts and seeds."""
from __future__ import annotations

import time

import torch


def tensor_parallel_section(dev: torch.device, a) -> dict:
    """The 2-rank tensor-parallel decode row: `ParallelRolloutWorker` (rank r on cuda:r, NCCL; or gloo ranks on
    the CPU with --tp-cpu) against the one-process `RolloutWorker` on the same random-weight preset, prompts and
    seeds: tokens/s of each (best of two timed calls after a warm-up call), the speedup, and whether every
    sequence got the same tokens (exact on CPU; bf16 reductions split over ranks may flip a near tie on a GPU).
    Without 2 GPUs (or --tp-cpu on the CPU) the row says why it did not run."""
    gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
    on_cpu = dev.type != "cuda" and a.tp_cpu
    if gpus < 2 and not on_cpu:
        return {"status": "skipped", "gpus": gpus,
                "reason": f"needs 2 GPUs, this run has {gpus}" + (" (--device cpu; --tp-cpu runs 2 CPU ranks)"
                                                                 if dev.type != "cuda" else "")}
    from ebpo.model import load_preset
    from rollout.parallel_worker import ParallelRolloutWorker
    from rollout.worker import RolloutWorker

    g = torch.Generator().manual_seed(0)
    spec = f"preset:{a.model}"
    vocab = load_preset(a.model).vocab_size
    batch = max(a.batches)
    prompts = [torch.randint(8, vocab - 8, (a.prompt_len,), generator=g).tolist() for _ in range(batch)]
    seeds = list(range(batch))
    decode = {"preset": a.preset, "temperature": a.temperature, "max_new_tokens": a.new_tokens,
              "stop_at_eos": False}
    device = "cuda" if dev.type == "cuda" else "cpu"
    row = {"status": "ran", "gpus": gpus, "ranks": 2, "batch": batch, "device": device}
    threads = torch.get_num_threads() if device == "cpu" else None  # CPU: the ranks split the one rank's threads
    one = RolloutWorker(spec, decode, device=str(dev), num_threads=threads)
    row["one_rank_tokens_per_s"], base = _timed_generate(one, prompts, seeds, dev)
    weights = {k: v.cpu() for k, v in one.model.state_dict().items()}
    del one  # its device memory, before the ranks take theirs
    tp = ParallelRolloutWorker(spec, decode, tensor_parallel=2, device=device, weights=weights, num_threads=threads)
    try:
        row["two_rank_tokens_per_s"], got = _timed_generate(tp, prompts, seeds, dev)
    finally:
        tp.close()
    row["speedup"] = row["two_rank_tokens_per_s"] / row["one_rank_tokens_per_s"]
    row["identical_tokens"] = [o["token_ids"] for o in got] == [o["token_ids"] for o in base]
    return row


def _timed_generate(worker, prompts, seeds, dev: torch.device) -> tuple[float, list[dict]]:
    """(new tokens per second, best of two timed calls after one warm-up call; the last call's samples)."""
    worker.generate(prompts, seeds)
    best, outs = float("inf"), []
    for _ in range(2):
        _sync(dev)
        t0 = time.perf_counter()
        outs = worker.generate(prompts, seeds)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return sum(len(o["token_ids"]) for o in outs) / best, outs


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
