"""Bucketed broadcast of the policy weights from the learner (rank 0) to the rollout workers (ranks 1..n).

The alternative to the object-store sync (`ray.weight_sync=broadcast`): the learner packs its state_dict,
in order, into flat single-dtype buckets of at most `bucket_bytes` and broadcasts them one by one over a
process group of its own (NCCL between GPUs, gloo on CPU). The plan (names, shapes, dtypes, offsets) goes
to the receivers through the group's TCPStore, so they can allocate each bucket before it arrives.

    plan = plan_buckets([(name, t.shape, t.dtype) for name, t in sd.items()], 256 << 20)
    flat = pack_bucket(sd, plan[0], "cpu")          # 1-D, plan[0].numel elements of plan[0].dtype
    views = unpack_bucket(flat, plan[0])            # name -> view of flat with the tensor's shape

    group = WeightBroadcastGroup(addr, port, rank, world_size, timeout_s=300)   # on every member at once
    group.send(sd, version, bucket_bytes)     # rank 0 -> SendStats(bytes, buckets, seconds)
    group.send_buckets(plan, version, fetch)  # rank 0, each bucket from `with fetch(bucket) as tensors`
    sd = group.receive(version)               # ranks 1.. -> {name: tensor}, every bucket alive at once
    group.receive(version, consume=load_part) # ranks 1..: each bucket's {name: tensor} as it arrives
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend

TensorSpec = tuple[str, Sequence[int], torch.dtype]


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket: elements [offset, offset + numel) of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in elements of `dtype`, from the start of the bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of one dtype, sent as one flat 1-D buffer of `numel` elements."""

    dtype: torch.dtype
    slots: tuple[Slot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


class SendStats(NamedTuple):
    bytes: int      # payload bytes broadcast (sum of bucket sizes)
    buckets: int    # broadcasts issued
    seconds: float  # wall time of packing and broadcasting, on the sender


@dataclass(frozen=True)
class WeightParts:
    """A state dict in the Ray object store as one reference per bucket (object-store sync of a sharded or
    large learner): a receiver fetches and loads one part at a time. Wrapping the list keeps Ray from
    resolving the references when it is passed to an actor method."""

    refs: tuple  # ObjectRefs, each of a dict name -> CPU tensor (whole tensors, in state-dict order)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Group (name, shape, dtype) specs, in order, into buckets of one dtype and at most `bucket_bytes` bytes.

    A bucket is closed when the next tensor has another dtype or would overflow it; a tensor larger than
    `bucket_bytes` therefore gets a bucket of its own. Order is kept so sender and receivers agree on
    offsets from the spec list alone.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0  # bytes in the open bucket
    for name, shape, dtype in specs:
        shape = tuple(int(d) for d in shape)
        numel = int(torch.Size(shape).numel())
        size = numel * _itemsize(dtype)
        if slots and (dtype != slots[0].dtype or used + size > bucket_bytes):
            buckets.append(Bucket(slots[0].dtype, tuple(slots)))
            slots, used = [], 0
        slots.append(Slot(name, shape, dtype, used // _itemsize(dtype), numel))
        used += size
    if slots:
        buckets.append(Bucket(slots[0].dtype, tuple(slots)))
    return buckets


def pack_bucket(tensors: Mapping[str, torch.Tensor], bucket: Bucket, device: str | torch.device) -> torch.Tensor:
    """Copy the bucket's tensors into one new flat tensor: shape (bucket.numel,), bucket.dtype, on `device`."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    for s in bucket.slots:
        t = tensors[s.name]
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise ValueError(f"{s.name}: tensor is {tuple(t.shape)} {t.dtype}, the plan says {s.shape} {s.dtype}")
        flat[s.offset: s.offset + s.numel].copy_(t.reshape(-1))
    return flat


def unpack_bucket(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """name -> tensor of the slot's shape. These are VIEWS into `flat` (no copy): clone them before reusing
    `flat`. Loading them into a model copies them, so a receiver that loads each bucket as it arrives
    (`WeightBroadcastGroup.receive(consume=...)`) keeps no second copy of the weights."""
    if flat.dim() != 1 or flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
        raise ValueError(f"flat buffer is {tuple(flat.shape)} {flat.dtype}, the bucket needs "
                         f"({bucket.numel},) {bucket.dtype}")
    return {s.name: flat[s.offset: s.offset + s.numel].view(s.shape) for s in bucket.slots}


def plan_to_json(plan: Sequence[Bucket], version: int) -> bytes:
    """The plan as JSON (not pickle: receivers read it from a TCP store, and unpickling network bytes would
    run whatever code they name)."""
    rows = [[str(b.dtype), [[s.name, list(s.shape), s.offset, s.numel] for s in b.slots]] for b in plan]
    return json.dumps({"version": version, "buckets": rows}).encode()


def plan_from_json(data: bytes, version: int) -> list[Bucket]:
    doc = json.loads(data)
    if doc["version"] != version:
        raise RuntimeError(f"weight sync: expected the plan of version {version}, the store holds {doc['version']}")
    plan = []
    for dtype_name, slots in doc["buckets"]:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight sync plan: {dtype_name!r} is not a torch dtype")
        plan.append(Bucket(dtype, tuple(Slot(n, tuple(shape), dtype, off, k) for n, shape, off, k in slots)))
    return plan


def state_dict_digest(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Bit-exact fingerprint of a state_dict: SHA-256 over sorted (name, dtype, shape, raw bytes), plus
    tensor and element counts. A hash, not a float sum, so thread count or reduction order cannot change
    it; two copies agree only if every bit does."""
    h = hashlib.sha256()
    numel = 0
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        numel += t.numel()
    return {"sha256": h.hexdigest(), "tensors": len(state_dict), "numel": numel}


def node_ip() -> str:
    """This process's node IP as Ray sees it (other nodes can reach it), else 127.0.0.1 outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _process_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
                   device: torch.device, local_addr: str) -> "Backend":
    """A standalone backend (never the default group, which DeepSpeed may own): NCCL for CUDA, else gloo."""
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("ray.weight_sync=broadcast on GPUs needs a torch build with NCCL")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False  # as torch.distributed.new_group does
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Bind gloo to the node IP (or GLOO_SOCKET_IFNAME): the default resolves the hostname, which on many
    # hosts maps to 127.0.1.1 and cannot be reached from other nodes.
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface.split(",")[0]) if iface
                     else dist.ProcessGroupGloo.create_device(hostname=local_addr)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


class WeightBroadcastGroup:
    """One member of the learner -> rollout-workers broadcast group. Rank 0 (the learner) hosts the
    TCPStore; every member must construct its group at the same time (the store and the backend wait for
    all `world_size` members, up to `timeout_s`). Every later wait (plan, bucket) is bounded by `timeout_s`.
    """

    def __init__(self, addr: str, port: int, rank: int, world_size: int, *, timeout_s: float = 300.0,
                 device: str | torch.device = "cpu", local_addr: str | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # NCCL binds one numbered device
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0), timeout=timeout)
        # Separate key spaces: the backend's rendezvous keys never meet our plan keys.
        self.plans = dist.PrefixStore("plan", self.store)
        self.pg = _process_group(dist.PrefixStore("pg", self.store), rank, world_size, timeout, self.device,
                                 local_addr or node_ip())
        self._last_plan: str | None = None

    def _broadcast(self, flat: torch.Tensor) -> None:
        if self.pg is None:
            raise RuntimeError("weight sync: this group was closed or aborted after a failure; form a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        # Broadcast copies bits, so bytes on the wire serve every dtype (bool, fp8, ...) on both backends.
        self.pg.broadcast([flat.view(torch.uint8)], opts).wait()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int, bucket_bytes: int) -> SendStats:
        """Rank 0: publish the plan of `version`, then broadcast it bucket by bucket (one at a time, so the
        extra memory is one bucket)."""
        plan = plan_buckets([(n, t.shape, t.dtype) for n, t in state_dict.items()], bucket_bytes)
        return self.send_buckets(plan, version, lambda bucket: contextlib.nullcontext(state_dict))

    def send_buckets(self, plan: Sequence[Bucket], version: int,
                     fetch: Callable[[Bucket], ContextManager[Mapping[str, torch.Tensor]]]) -> SendStats:
        """Rank 0: publish `plan` as `version` and broadcast its buckets in order. `fetch(bucket)` is a context
        manager giving that bucket's tensors (name -> tensor), e.g. gathered from ZeRO-3 shards for the
        duration of the block: each bucket is packed inside it and broadcast after it, so the sender holds
        one gathered bucket and one packed copy at a time."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 (the learner) sends weights")
        start = time.perf_counter()
        key = str(version)
        self.plans.set(key, plan_to_json(plan, version))
        if self._last_plan is not None:
            # Every receiver finished the previous version before this sync started (the trainer waits).
            self.plans.delete_key(self._last_plan)
        self._last_plan = key
        try:
            for bucket in plan:
                with fetch(bucket) as tensors:
                    flat = pack_bucket(tensors, bucket, self.device)
                self._broadcast(flat)
                del flat
            self._synchronize()
        except BaseException:
            self._abort()
            raise
        return SendStats(sum(b.nbytes for b in plan), len(plan), time.perf_counter() - start)

    def receive(self, version: int, consume: Callable[[dict[str, torch.Tensor]], None] | None = None
                ) -> dict[str, torch.Tensor]:
        """Ranks 1..: wait for the plan of `version` and receive every bucket.

        Without `consume`, returns name -> tensor on this member's device (views into the received buckets):
        every bucket is alive at once, one extra copy of the weights. With `consume`, each bucket's
        name -> tensor views are handed to `consume` as soon as that bucket arrives and are dropped before
        the next one is received, so the extra memory is one bucket; returns {}. An error inside `consume`
        aborts the group like a failed collective (the other members are mid-version)."""
        if self.rank == 0:
            raise RuntimeError("rank 0 (the learner) sends, it does not receive")
        out: dict[str, torch.Tensor] = {}
        try:
            plan = plan_from_json(self.plans.get(str(version)), version)
            for bucket in plan:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
                self._broadcast(flat)
                part = unpack_bucket(flat, bucket)
                if consume is None:
                    out.update(part)
                else:
                    consume(part)
                del flat, part  # before the next bucket is allocated: at most one bucket alive
            self._synchronize()
        except BaseException:
            self._abort()
            raise
        return out

    def _abort(self) -> None:
        """After a failed collective the group is unusable (members disagree on the bucket they are in).
        Dropping the backend closes its connections (gloo's shutdown/abort leave them open), so members still
        waiting on this one fail now instead of at the timeout."""
        pg, self.pg = self.pg, None
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 (the original error is the one worth raising)
            pass
        del pg

    def close(self) -> None:
        """Release the backend and the store (rank 0 stops the store server). Safe to call twice."""
        if getattr(self, "pg", None) is not None:
            self._abort()
        self.plans = self.store = None
