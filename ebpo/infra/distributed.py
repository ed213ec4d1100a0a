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
