"""The learner as a Ray actor: `RLTrainer` creates one per learner rank (`ebpo.rl.learner_group`); each
builds the EBPO learner in its own process (so the driver never holds a model). Rank 0 speaks for the
group: it hosts the ranks' rendezvous, is rank 0 of the weight-sync group with `ray.weight_sync=broadcast`
and writes the exported model."""
from __future__ import annotations

import os

import ray
import torch
from rollout.weight_sync import WeightBroadcastGroup, WeightParts, node_ip, state_dict_digest

from ebpo.infra.distributed import free_port
from ebpo.model.loading import load_model
from ebpo.model.streamed_save import save_pretrained_streamed
from ebpo.rl.learner import EBPOLearner
from ebpo.rl.learner_config import LearnerConfig
from ebpo.rl.records import LearnerBatch
from ebpo.rl.weight_stream import WeightStreamer


class LearnerActor:
    """Builds the learner inside its own process (so the driver never holds a model) and forwards calls."""

    def __init__(self, model_spec: str, config: LearnerConfig, num_threads: int = 0, rank: int = 0):
        """config: the recipe's learner section as `RLConfig` built and checked it (not checked again)."""
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        self.model_spec, self.config, self.rank = model_spec, config, rank
        self.world_size = config.num_workers
        self.learner = None
        self.sync_group = None  # WeightBroadcastGroup (rank 0) with ray.weight_sync=broadcast
        if self.world_size == 1:
            self._build()

    def rendezvous_endpoint(self) -> tuple[str, int]:
        """(node IP, free port) for the learner group's torch.distributed rendezvous, hosted by this rank."""
        return self.sync_endpoint()

    def join_group(self, addr: str, port: int) -> None:
        """Join the learner ranks' process group (gloo on CPU, NCCL on GPU) and build the learner; blocks
        until every rank has joined. Each actor sees its own GPU (Ray sets CUDA_VISIBLE_DEVICES)."""
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(self.rank), LOCAL_RANK="0",
                          WORLD_SIZE=str(self.world_size))
        self._build()

    def _build(self) -> None:
        self.learner = EBPOLearner(load_model(self.model_spec), self.config)

    def update(self, batch: LearnerBatch) -> dict:
        return self.learner.update(batch)

    def state_dict_for_sync(self) -> dict:
        """Rank 0: the full weights; other ranks join the gather (ZeRO-3) and return {}."""
        state = self.learner.state_dict_for_sync()
        return state if self.rank == 0 else {}

    def _streamer(self, bucket_bytes: int):
        """The policy's weights in buckets of `bucket_bytes` (ZeRO-3: gathered one bucket at a time)."""
        return WeightStreamer(self.learner.get_model(), self.learner.gathers_weights, bucket_bytes)

    def weight_parts(self, bucket_bytes: int):
        """Object-store sync: rank 0 puts each bucket in the object store as it is gathered and returns a
        `rollout.weight_sync.WeightParts` of their references (no full copy in this process at any time);
        other ranks join the gathers and return None."""
        streamer = self._streamer(bucket_bytes)
        if self.rank != 0:
            streamer.drain()
            return None
        return WeightParts(tuple(ray.put(part) for part in streamer.cpu_buckets()))

    def weights_digest(self) -> dict:
        """SHA-256 and counts of `state_dict_for_sync()` (see `rollout.weight_sync.state_dict_digest`)."""
        return state_dict_digest(self.learner.state_dict_for_sync())

    # Broadcast weight sync (ray.weight_sync=broadcast): the learner is rank 0 and hosts the group's store.
    def sync_endpoint(self) -> tuple[str, int]:
        """(node IP, free port) on which `join_sync_group` will host the group's TCPStore."""
        # The port is checked on 0.0.0.0: the store listens on every interface, not only the one dialled.
        return node_ip(), free_port("0.0.0.0")

    def join_sync_group(self, addr: str, port: int, world_size: int, timeout_s: float, device: str = "cpu") -> None:
        """Form the group as rank 0; blocks until all `world_size` members join (up to `timeout_s`)."""
        self.close_sync_group()
        self.sync_group = WeightBroadcastGroup(addr, port, 0, world_size, timeout_s=timeout_s, device=device)

    def broadcast_weights(self, version: int, bucket_bytes: int) -> dict:
        """Send the policy as `version`, gathered and broadcast one bucket at a time; returns {"bytes",
        "buckets", "seconds"} of the send (rank 0; the other ranks join the gathers and return {})."""
        streamer = self._streamer(bucket_bytes)
        if self.rank != 0:
            streamer.drain()
            return {}
        if self.sync_group is None:
            raise RuntimeError("broadcast_weights: the learner is in no weight-sync group")
        stats = self.sync_group.send_buckets(streamer.plan, version, streamer.gathered)
        return stats._asdict()

    def close_sync_group(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
            self.sync_group = None

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> None:
        self.learner.load(path)

    def export(self, path: str, bucket_bytes: int = 1 << 30) -> None:
        """Rank 0 writes the policy as a Hugging Face folder, one safetensors shard per bucket of
        `bucket_bytes` as it is gathered (ZeRO-3: every rank joins each bucket's gather)."""
        streamer = self._streamer(bucket_bytes)
        if self.rank != 0:
            streamer.drain()
            return
        save_pretrained_streamed(self.learner.model_config, path, streamer.cpu_buckets(), len(streamer.plan))
