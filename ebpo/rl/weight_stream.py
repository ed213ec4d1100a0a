"""The learner's weights bucket by bucket, gathered from ZeRO-3 shards one bucket at a time.

Weight sync and export used to gather the whole model on rank 0 (`GatheredParameters(all params)`) and
clone it to host memory: 32 GB for LLaDA2.1-mini in bf16 on top of rank 0's shard, and a second clone in
the Ray object store. `WeightStreamer` instead walks a fixed plan of buckets (whole tensors of one dtype, at
most `bucket_bytes`, in state-dict order: `rollout.weight_sync.plan_buckets`) and gathers only the current
bucket's parameters, which are released (re-partitioned) before the next bucket is gathered. Every learner
rank must walk the same plan in the same order: the gathers are collectives.

Three consumers: the broadcast sync (rank 0 packs each gathered bucket and broadcasts it), the object-store
sync (rank 0 puts each bucket in the object store and hands the workers the list of references), and export
(rank 0 writes each bucket as one safetensors shard, `ebpo.model.streamed_save`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from rollout.weight_sync import Bucket, plan_buckets


class WeightStreamer:
    """Buckets of a policy's state dict. model: the policy module (a ZeRO-3 engine's module or a plain one);
    zero3: its parameters are ZeRO-3 partitioned (they carry `ds_shape`); bucket_bytes: bucket size in bytes.
    """

    def __init__(self, model: nn.Module, zero3: bool, bucket_bytes: int):
        self.model, self.zero3 = model, zero3
        # Parameters and persistent buffers by state-dict name; keep_vars: the objects themselves, so that a
        # ZeRO-3 parameter is the handle `GatheredParameters` needs, not an empty placeholder tensor.
        self.tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.plan: list[Bucket] = plan_buckets([(n, self._shape(t), t.dtype) for n, t in self.tensors.items()],
                                               bucket_bytes)

    def _shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.ds_shape) if self.zero3 and hasattr(t, "ds_shape") else tuple(t.shape)

    @contextlib.contextmanager
    def gathered(self, bucket: Bucket) -> Iterator[dict[str, torch.Tensor]]:
        """name -> full tensor (detached views on the learner's device) for this bucket's tensors, valid
        inside the block only: on exit ZeRO-3 partitions the parameters again. A collective under ZeRO-3."""
        tensors = {s.name: self.tensors[s.name] for s in bucket.slots}
        partitioned = [t for t in tensors.values() if self.zero3 and hasattr(t, "ds_id")]
        if partitioned:
            import deepspeed  # only a ZeRO-3 learner needs it; importing it is slow and probes the accelerator

            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
                yield {n: t.detach() for n, t in tensors.items()}
        else:
            yield {n: t.detach() for n, t in tensors.items()}

    def cpu_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each bucket in turn as name -> CPU copy (owned by the caller). Every rank must exhaust it."""
        for bucket in self.plan:
            with self.gathered(bucket) as tensors:
                yield {n: t.to("cpu", copy=True) for n, t in tensors.items()}

    def drain(self) -> None:
        """Walk the plan without keeping anything: a rank other than 0 joins rank 0's gathers this way."""
        for bucket in self.plan:
            with self.gathered(bucket):
                pass
