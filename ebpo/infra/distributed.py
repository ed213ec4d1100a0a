"""World-size-1 torch.distributed set-up for DeepSpeed engines started outside a launcher."""
from __future__ import annotations

import os
import socket

import torch


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now ("0.0.0.0": free on every IPv4 interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) from RANK/WORLD_SIZE/MASTER_* or as a
    single process on 127.0.0.1 and a free port; does nothing when a launcher already set it up."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def all_reduce_grads(params: list, bucket_numel: int = 2 ** 25) -> None:
    """Sum the gradients of `params` over the default process group in place (what DDP does, without its
    hooks: gradient replay calls backward several times per step). A parameter without a gradient on this
    rank counts as zeros, so every rank joins the same collectives. Flat fp32-or-native buckets of at
    most `bucket_numel` elements keep the number of collectives small."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        bucket, size = [], 0
        for p in group + [None]:
            if p is not None and (size + p.grad.numel() <= bucket_numel or not bucket):
                bucket.append(p)
                size += p.grad.numel()
                continue
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])
            dist.all_reduce(flat)
            offset = 0
            for q in bucket:
                q.grad.copy_(flat[offset: offset + q.grad.numel()].view_as(q.grad))
                offset += q.grad.numel()
            bucket, size = ([p], p.grad.numel()) if p is not None else ([], 0)
