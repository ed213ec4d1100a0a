"""The learner as a Ray actor: `RLTrainer` creates it with `ray.remote`; it builds the EBPO learner in its
own process (so the driver never holds a model) and, with `ray.weight_sync=broadcast`, is rank 0 of the
weight-sync group."""
from __future__ import annotations

import os

import torch

from ebpo.infra.config import build


class LearnerActor:
    """Builds the learner inside its own process (so the driver never holds a model) and forwards calls."""

    def __init__(self, model_spec: str, learner_fields: dict, num_threads: int = 0):
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        from ebpo.rl.learner import EBPOLearner, LearnerConfig
        from ebpo.model.loading import load_model

        self.learner = EBPOLearner(load_model(model_spec), build(LearnerConfig, learner_fields, "learner."))
        self.sync_group = None  # WeightBroadcastGroup (rank 0) with ray.weight_sync=broadcast

    def update(self, batch: dict) -> dict:
        return self.learner.update(batch)

    def state_dict_for_sync(self) -> dict:
        return self.learner.state_dict_for_sync()

    def weights_digest(self) -> dict:
        """SHA-256 and counts of `state_dict_for_sync()` (see `rollout.weight_sync.state_dict_digest`)."""
        from rollout.weight_sync import state_dict_digest

        return state_dict_digest(self.learner.state_dict_for_sync())

    # Broadcast weight sync (ray.weight_sync=broadcast): the learner is rank 0 and hosts the group's store.
    def sync_endpoint(self) -> tuple[str, int]:
        """(node IP, free port) on which `join_sync_group` will host the group's TCPStore."""
        # The port is checked on 0.0.0.0: the store listens on every interface, not only the one dialled.
        from ebpo.infra.distributed import free_port
        from rollout.weight_sync import node_ip

        return node_ip(), free_port("0.0.0.0")

    def join_sync_group(self, addr: str, port: int, world_size: int, timeout_s: float, device: str = "cpu") -> None:
        """Form the group as rank 0; blocks until all `world_size` members join (up to `timeout_s`)."""
        from rollout.weight_sync import WeightBroadcastGroup

        self.close_sync_group()
        self.sync_group = WeightBroadcastGroup(addr, port, 0, world_size, timeout_s=timeout_s, device=device)

    def broadcast_weights(self, version: int, bucket_bytes: int) -> dict:
        """Send `state_dict_for_sync()` as `version`; returns {"bytes", "buckets", "seconds"} of the send."""
        if self.sync_group is None:
            raise RuntimeError("broadcast_weights: the learner is in no weight-sync group")
        stats = self.sync_group.send(self.learner.state_dict_for_sync(), version, bucket_bytes)
        return stats._asdict()

    def close_sync_group(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
            self.sync_group = None

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> None:
        self.learner.load(path)

    def export(self, path: str) -> None:
        self.learner.get_model().save_pretrained(path)
