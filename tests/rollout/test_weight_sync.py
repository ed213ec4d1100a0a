"""rollout/weight_sync.py in this process, without Ray.

The bucket plan against a plain loop of its rule, packing and unpacking, the JSON plan, the digest against
hashlib written out, the process-group options (torch's classes replaced by recorders), the group's send /
receive bookkeeping over a fake backend and store (plan keys, versions, ranks, aborts), and one real two-rank
gloo round trip in threads.
"""
import contextlib
import datetime
import hashlib
import json
import random
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist

import rollout.weight_sync as ws
from rollout.weight_sync import (Bucket, SendStats, Slot, WeightBroadcastGroup, pack_bucket, plan_buckets,
                                 plan_from_json, plan_to_json, state_dict_digest, unpack_bucket)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool, torch.uint8]
SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.int64: 8, torch.float16: 2, torch.bool: 1, torch.uint8: 1}


def reference_plan(specs, bucket_bytes):
    """The documented rule, as a plain loop over (name, shape, dtype)."""
    out, cur, used = [], [], 0
    for name, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= d
        size = numel * SIZE[dtype]
        if cur and (cur[0][2] != dtype or used + size > bucket_bytes):
            out.append(cur)
            cur, used = [], 0
        cur.append((name, tuple(shape), dtype, used // SIZE[dtype], numel))
        used += size
    if cur:
        out.append(cur)
    return [Bucket(b[0][2], tuple(Slot(*s) for s in b)) for b in out]


def random_specs(rng, n):
    specs, dtype = [], rng.choice(DTYPES)
    for i in range(n):
        if rng.random() < 0.4:
            dtype = rng.choice(DTYPES)
        specs.append((f"t{i}", [rng.choice([0, 1, 2, 3, 4, 8]) for _ in range(rng.randint(0, 3))], dtype))
    return specs


@pytest.mark.parametrize("seed", range(8))
def test_plan_buckets_against_the_rule(seed):
    rng = random.Random(seed)
    specs = random_specs(rng, 30)
    for limit in (1, 8, 16, 64, 10**6):
        plan = plan_buckets(specs, limit)
        assert plan == reference_plan(specs, limit), limit
        for b in plan:
            assert b.numel == sum(s.numel for s in b.slots) and b.nbytes == b.numel * SIZE[b.dtype]
            assert all(isinstance(s.shape, tuple) and all(type(d) is int for d in s.shape) for s in b.slots)


def test_plan_buckets_edges():
    f = torch.float32
    # exactly full fits; one byte more opens a new bucket
    assert [len(b.slots) for b in plan_buckets([("a", (2,), f), ("b", (2,), f)], 16)] == [2]
    assert [len(b.slots) for b in plan_buckets([("a", (2,), f), ("b", (3,), f)], 16)] == [1, 1]
    big = plan_buckets([("a", (1,), f), ("b", (100,), f), ("c", (1,), f)], 8)
    assert [[s.name for s in b.slots] for b in big] == [["a"], ["b"], ["c"]]  # too large: a bucket of its own
    assert plan_buckets([], 8) == []
    mixed = plan_buckets([("a", torch.Size([2, 2]), torch.bfloat16), ("b", (3,), torch.bfloat16)], 100)
    assert mixed == [Bucket(torch.bfloat16, (Slot("a", (2, 2), torch.bfloat16, 0, 4),
                                              Slot("b", (3,), torch.bfloat16, 4, 3)))]
    for bad in (0, -1):
        with pytest.raises(ValueError) as err:
            plan_buckets([("a", (1,), f)], bad)
        assert str(err.value) == f"bucket_bytes must be positive, got {bad}"


def test_pack_and_unpack():
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(2, 3, generator=g), "b": torch.randn(4, generator=g), "c": torch.randn((), generator=g),
          "i": torch.arange(5)}
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in sd.items()], 24)
    assert len(plan) >= 3
    for b in plan:
        flat = pack_bucket(sd, b, "cpu")
        assert flat.shape == (b.numel,) and flat.dtype == b.dtype and flat.dim() == 1
        for s in b.slots:
            assert torch.equal(flat[s.offset:s.offset + s.numel], sd[s.name].reshape(-1))
        parts = unpack_bucket(flat, b)
        assert list(parts) == [s.name for s in b.slots]
        for name, t in parts.items():
            assert torch.equal(t, sd[name]) and t.shape == sd[name].shape
            assert t.data_ptr() >= flat.data_ptr() and t._base is flat  # views, not copies
    b = plan_buckets([("a", (2, 3), torch.float32)], 100)[0]
    assert pack_bucket(sd, b, "meta").device.type == "meta"
    with pytest.raises(ValueError) as err:
        pack_bucket({"a": torch.zeros(3, 2)}, b, "cpu")
    assert str(err.value) == "a: tensor is (3, 2) torch.float32, the plan says (2, 3) torch.float32"
    with pytest.raises(ValueError) as err:
        pack_bucket({"a": torch.zeros(2, 3, dtype=torch.float64)}, b, "cpu")
    assert str(err.value) == "a: tensor is (2, 3) torch.float64, the plan says (2, 3) torch.float32"
    for flat in (torch.zeros(2, 3), torch.zeros(5), torch.zeros(7), torch.zeros(6, dtype=torch.float64)):
        with pytest.raises(ValueError) as err:
            unpack_bucket(flat, b)
        assert str(err.value) == (f"flat buffer is {tuple(flat.shape)} {flat.dtype}, the bucket needs (6,) "
                                  "torch.float32")


def test_plan_json_round_trip_and_checks():
    rng = random.Random(3)
    plan = plan_buckets(random_specs(rng, 12), 16)
    data = plan_to_json(plan, 7)
    assert isinstance(data, bytes)
    doc = json.loads(data)
    assert doc["version"] == 7
    assert doc["buckets"] == [[str(b.dtype), [[s.name, list(s.shape), s.offset, s.numel] for s in b.slots]]
                              for b in plan]
    assert plan_from_json(data, 7) == plan
    with pytest.raises(RuntimeError) as err:
        plan_from_json(data, 8)
    assert str(err.value) == "weight sync: expected the plan of version 8, the store holds 7"
    plain = json.dumps({"version": 1, "buckets": [["float16", [["x", [2], 0, 2]]]]}).encode()
    assert plan_from_json(plain, 1) == [Bucket(torch.float16, (Slot("x", (2,), torch.float16, 0, 2),))]
    bad = json.dumps({"version": 1, "buckets": [["torch.Tensor", [["x", [2], 0, 2]]]]}).encode()
    with pytest.raises(ValueError) as err:
        plan_from_json(bad, 1)
    assert str(err.value) == "weight sync plan: 'torch.Tensor' is not a torch dtype"


def reference_digest(sd):
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def test_state_dict_digest():
    g = torch.Generator().manual_seed(1)
    sd = {"b": torch.randn(3, 2, generator=g).t(), "a": torch.randn(4, generator=g).bfloat16(),
          "s": torch.tensor(3), "e": torch.zeros(0, 2)}
    d = state_dict_digest(sd)
    assert d == {"sha256": reference_digest(sd), "tensors": 4, "numel": 6 + 4 + 1 + 0}
    assert state_dict_digest(dict(reversed(list(sd.items())))) == d  # order does not matter
    for change in ({"a": sd["a"].float()}, {"b": sd["b"].reshape(3, 2)}, {"s": torch.tensor(4)}):
        assert state_dict_digest({**sd, **change})["sha256"] != d["sha256"]
    renamed = {("z" if k == "s" else k): v for k, v in sd.items()}
    assert state_dict_digest(renamed)["sha256"] != d["sha256"]
    p = torch.nn.Parameter(torch.ones(2))
    assert state_dict_digest({"p": p}) == state_dict_digest({"p": torch.ones(2)})  # no grad needed


def test_node_ip(monkeypatch):
    fake = types.SimpleNamespace(is_initialized=lambda: True,
                                 util=types.SimpleNamespace(get_node_ip_address=lambda: "10.1.2.3"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert ws.node_ip() == "10.1.2.3"
    fake.is_initialized = lambda: False
    assert ws.node_ip() == "127.0.0.1"
    monkeypatch.setitem(sys.modules, "ray", None)  # not installed: import fails
    assert ws.node_ip() == "127.0.0.1"


class Rec:
    """Records construction; stands in for torch's backend, options and device classes."""

    made: list = []

    def __init__(self, *args):
        self.args = args
        Rec.made.append(self)


def test_gloo_process_group_options(monkeypatch):
    devices = []

    class Gloo(Rec):
        class _Options:
            pass

        @staticmethod
        def create_device(**kw):
            devices.append(kw)
            return ("dev", kw)

    monkeypatch.setattr(dist, "ProcessGroupGloo", Gloo)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    timeout = datetime.timedelta(seconds=12)
    pg = ws._process_group("store", 1, 3, timeout, torch.device("cpu"), "10.0.0.5")
    assert isinstance(pg, Gloo) and pg.args[:3] == ("store", 1, 3)
    opts = pg.args[3]
    assert opts._timeout == timeout and opts._devices == [("dev", {"hostname": "10.0.0.5"})]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1,eth2")
    pg = ws._process_group("store", 0, 2, timeout, torch.device("cpu"), "10.0.0.5")
    assert pg.args[3]._devices == [("dev", {"interface": "eth1"})]


def test_nccl_process_group_options(monkeypatch):
    set_dev = []

    class NCCL(Rec):
        class Options:
            pass

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", set_dev.append)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    timeout = datetime.timedelta(seconds=5)
    dev = torch.device("cuda", 1)
    pg = ws._process_group("st", 2, 4, timeout, dev, "x")
    assert isinstance(pg, NCCL) and pg.args[:3] == ("st", 2, 4) and set_dev == [dev]
    assert pg.args[3].is_high_priority_stream is False and pg.args[3]._timeout == timeout
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(RuntimeError) as err:
        ws._process_group("st", 2, 4, timeout, dev, "x")
    assert str(err.value) == "ray.weight_sync=broadcast on GPUs needs a torch build with NCCL"


def test_group_init_wires_store_and_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: calls.append(("tcp", a, kw)) or "STORE")
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setattr(ws, "_process_group", lambda *a: calls.append(("pg", a)) or "PG")
    monkeypatch.setattr(ws, "node_ip", lambda: "9.9.9.9")
    g = WeightBroadcastGroup("host", 1234, 0, 3, timeout_s=7.5)
    t = datetime.timedelta(seconds=7.5)
    assert calls == [("tcp", ("host", 1234, 3), dict(is_master=True, timeout=t)),
                     ("pg", (("pg", "STORE"), 0, 3, t, torch.device("cpu"), "9.9.9.9"))]
    assert (g.rank, g.world_size, g.device, g.store, g.plans, g.pg, g._last_plan) == \
        (0, 3, torch.device("cpu"), "STORE", ("plan", "STORE"), "PG", None)
    calls.clear()
    g = WeightBroadcastGroup("host", 1, 2, 3, device="meta", local_addr="1.2.3.4")
    assert calls[0][2]["is_master"] is False and calls[0][2]["timeout"] == datetime.timedelta(seconds=300)
    assert calls[1][1][4:] == (torch.device("meta"), "1.2.3.4")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    g = WeightBroadcastGroup("host", 1, 1, 3, device="cuda")
    assert g.device == torch.device("cuda", 5)  # NCCL binds one numbered device
    g = WeightBroadcastGroup("host", 1, 1, 3, device="cuda:2")
    assert g.device == torch.device("cuda", 2)
    for rank, world in ((-1, 2), (2, 2), (0, 0)):
        with pytest.raises(ValueError) as err:
            WeightBroadcastGroup("host", 1, rank, world)
        assert str(err.value) == f"rank {rank} is outside a group of {world}"


class FakeStore:
    def __init__(self):
        self.data, self.log = {}, []

    def set(self, key, value):
        self.log.append(("set", key))
        self.data[key] = value

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        self.log.append(("delete", key))
        del self.data[key]


class Wire:
    """A fake backend shared by the members: the sender's broadcasts queue bytes, receivers take them."""

    def __init__(self, fail_at=None):
        self.sent, self.fail_at, self.roots, self.shutdowns = [], fail_at, [], 0

    def pg(self, rank):
        wire = self

        class PG:
            def broadcast(self, tensors, opts):
                (t,) = tensors
                assert t.dtype == torch.uint8 and t.dim() == 1
                wire.roots.append(opts.rootRank)
                if wire.fail_at is not None and len(wire.roots) > wire.fail_at:
                    raise RuntimeError("connection closed")
                if rank == 0:
                    wire.sent.append(t.clone())
                else:
                    t.copy_(wire.sent.pop(0))
                return types.SimpleNamespace(wait=lambda: None)

            def shutdown(self):
                wire.shutdowns += 1

        return PG()


def member(rank, store, wire, world=2):
    g = object.__new__(WeightBroadcastGroup)
    g.rank, g.world_size, g.device, g.plans, g.store = rank, world, torch.device("cpu"), store, "S"
    g.pg, g._last_plan = wire.pg(rank), None
    return g


def sample(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "h": torch.randn(5, generator=g).bfloat16(),
            "n": torch.tensor(seed), "m": torch.randn(2, generator=g).bfloat16(), "x": torch.randn(7, generator=g)}


def test_send_then_receive_over_the_fake_wire():
    store, wire = FakeStore(), Wire()
    sender, receiver = member(0, store, wire), member(1, store, wire)
    for version in (3, 4, 9):
        sd = sample(version)
        plan = plan_buckets([(n, t.shape, t.dtype) for n, t in sd.items()], 16)
        stats = sender.send(sd, version, 16)
        assert isinstance(stats, SendStats)
        assert stats.bytes == sum(t.numel() * t.element_size() for t in sd.values()) == sum(b.nbytes for b in plan)
        assert stats.buckets == len(plan) >= 4 and stats.seconds >= 0
        assert store.data == {str(version): plan_to_json(plan, version)}  # the previous plan key is deleted
        got = receiver.receive(version)
        assert list(got) == list(sd) and not wire.sent
        for k, v in sd.items():
            assert torch.equal(got[k], v) and got[k].dtype == v.dtype
    assert store.log == [("set", "3"), ("set", "4"), ("delete", "3"), ("set", "9"), ("delete", "4")]
    assert set(wire.roots) == {0} and wire.shutdowns == 0


def test_streaming_receive_and_fetch_order():
    store, wire = FakeStore(), Wire()
    sender, receiver = member(0, store, wire), member(1, store, wire)
    sd = sample(1)
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in sd.items()], 16)
    events = []

    @contextlib.contextmanager
    def fetch(bucket):
        events.append(("enter", [s.name for s in bucket.slots], len(wire.sent)))
        yield {s.name: sd[s.name] for s in bucket.slots}
        events.append(("exit", len(wire.sent)))

    stats = sender.send_buckets(plan, 2, fetch)
    assert stats.buckets == len(plan) and stats.bytes == sum(b.nbytes for b in plan)
    # each bucket is fetched, packed inside the block and broadcast after it
    assert events == [e for i, b in enumerate(plan) for e in (("enter", [s.name for s in b.slots], i), ("exit", i))]
    parts = []
    assert receiver.receive(2, consume=lambda p: parts.append({k: v.clone() for k, v in p.items()})) == {}
    assert [list(p) for p in parts] == [[s.name for s in b.slots] for b in plan]
    for p in parts:
        for k, v in p.items():
            assert torch.equal(v, sd[k])


def test_roles_are_checked():
    store, wire = FakeStore(), Wire()
    with pytest.raises(RuntimeError) as err:
        member(1, store, wire).send(sample(0), 1, 16)
    assert str(err.value) == "only rank 0 (the learner) sends weights"
    with pytest.raises(RuntimeError) as err:
        member(0, store, wire).receive(1)
    assert str(err.value) == "rank 0 (the learner) sends, it does not receive"
    assert store.log == [] and wire.roots == []


@pytest.mark.parametrize("side", ["send", "receive", "consume"])
def test_a_failure_aborts_the_group(side):
    store, wire = FakeStore(), Wire()
    sender, receiver = member(0, store, wire), member(1, store, wire)
    sd = sample(2)
    if side == "send":
        wire.fail_at = 2
        with pytest.raises(RuntimeError, match="connection closed"):
            sender.send(sd, 1, 16)
        g = sender
    else:
        sender.send(sd, 1, 16)
        if side == "receive":
            wire.fail_at = len(wire.roots) + 1
            consume = None
        else:
            def consume(part):
                raise KeyError("bad part")
        with pytest.raises((RuntimeError, KeyError)):
            receiver.receive(1, consume=consume)
        g = receiver
    assert g.pg is None and wire.shutdowns == 1
    with pytest.raises(RuntimeError) as err:
        g._broadcast(torch.zeros(1))
    assert str(err.value) == "weight sync: this group was closed or aborted after a failure; form a new one"
    g.close()
    assert wire.shutdowns == 1 and g.plans is None and g.store is None


def test_abort_keeps_the_original_error_when_shutdown_fails():
    g = member(0, FakeStore(), Wire())

    class Bad:
        def shutdown(self):
            raise OSError("already closed")

    g.pg = Bad()
    g._abort()
    assert g.pg is None


def test_close_twice():
    wire = Wire()
    g = member(0, FakeStore(), wire)
    g.close()
    g.close()
    assert wire.shutdowns == 1 and g.pg is None and g.plans is None and g.store is None


def test_missing_plan_version_fails_the_receiver():
    store, wire = FakeStore(), Wire()
    member(0, store, wire).send(sample(0), 5, 16)
    receiver = member(1, store, wire)
    with pytest.raises(KeyError):
        receiver.receive(6)
    assert receiver.pg is None and wire.shutdowns == 1


def test_real_two_rank_gloo_round_trip():
    """The real backend once: two members in threads of this process, bits and dtypes through unchanged."""
    from ebpo.infra.distributed import free_port

    port, sd, results, errors = free_port(), sample(7), {}, []

    def run(rank):
        group = None
        try:
            group = WeightBroadcastGroup("127.0.0.1", port, rank, 2, timeout_s=30, local_addr="127.0.0.1")
            results[rank] = group.send(sd, 1, 16) if rank == 0 else group.receive(1)
        except BaseException as err:  # noqa: BLE001 (re-raised below)
            errors.append(err)
        finally:
            if group is not None:
                group.close()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    got = results[1]
    assert list(got) == list(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    assert results[0].buckets == len(plan_buckets([(n, t.shape, t.dtype) for n, t in sd.items()], 16))


def test_buckets_live_on_the_group_s_device():
    """Packed (sender) and allocated (receiver) on the member's device (`meta` stands in for a GPU)."""
    store, wire = FakeStore(), Wire()
    sender, receiver = member(0, store, wire), member(1, store, wire)
    sender.device = receiver.device = torch.device("meta")
    seen = []
    real = wire.pg

    def pg(rank):
        inner = real(rank)

        class Spy:
            def broadcast(self, tensors, opts):
                seen.append((rank, tensors[0].device.type))
                if rank == 0:
                    wire.sent.append(tensors[0].clone())
                else:
                    wire.sent.pop(0)
                return types.SimpleNamespace(wait=lambda: None)

            def shutdown(self):
                inner.shutdown()

        return Spy()

    sender.pg, receiver.pg = pg(0), pg(1)
    sender.send(sample(1), 1, 16)
    got = receiver.receive(1)
    assert seen and {d for _, d in seen} == {"meta"} and {r for r, _ in seen} == {0, 1}
    assert {t.device.type for t in got.values()} == {"meta"}


def test_synchronize_waits_for_the_group_s_gpu_only(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    g = member(0, FakeStore(), Wire())
    g._synchronize()
    assert synced == []  # CPU: nothing to wait for
    g.device = torch.device("cuda", 1)
    g._synchronize()
    assert synced == [torch.device("cuda", 1)]


def test_close_a_group_whose_construction_failed():
    """__init__ can fail before the backend exists (the store did not form): close() must still work."""
    g = object.__new__(WeightBroadcastGroup)
    g.close()
    assert g.plans is None and g.store is None


def test_send_seconds_is_the_elapsed_wall_time(monkeypatch):
    clock = iter([1000.0, 1002.5])
    monkeypatch.setattr(ws.time, "perf_counter", lambda: next(clock))
    stats = member(0, FakeStore(), Wire()).send(sample(0), 1, 10**6)
    assert stats.seconds == 2.5 and stats.buckets == 5  # five dtype runs
