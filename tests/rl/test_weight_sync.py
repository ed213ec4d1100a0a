"""Bucketed broadcast weight sync (`rollout.weight_sync`, `ray.weight_sync=broadcast`): the bucket plan, a real
3-rank gloo group, and RL runs through real Ray actors on the tiny model (CPU only)."""
import math
import random
import threading
import time
import weakref

import pytest
import torch

from ebpo.infra.config import ConfigError, load_config
from ebpo.infra.distributed import free_port
from ebpo.rl.config import RLConfig
from rollout.weight_sync import (WeightBroadcastGroup, pack_bucket, plan_buckets, plan_from_json, plan_to_json,
                              state_dict_digest, unpack_bucket)

# The end-to-end helpers and fixtures of the RL tests (a module-scoped local Ray, a tiny data set, the config).
from tests.support.ray_runs import data, make_cfg, ray, ray_local  # noqa: E402,F401

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool]


def random_specs(rng: random.Random, n: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Mixed dtypes, runs of one dtype, scalars, empty tensors and tensors far above a 256-byte limit."""
    specs, dtype = [], rng.choice(DTYPES)
    for i in range(n):
        if rng.random() < 0.4:
            dtype = rng.choice(DTYPES)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 8, 40]) for _ in range(rng.randint(0, 3)))
        specs.append((f"layer{i}.w", shape, dtype))
    return specs


def random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-2**40, 2**40, shape, generator=gen, dtype=dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("seed", range(6))
def test_plan_buckets_properties_and_pack_round_trip(seed):
    rng = random.Random(seed)
    specs = random_specs(rng, rng.randint(1, 60))
    limit = rng.choice([1, 16, 64, 256, 1000])
    plan = plan_buckets(specs, limit)

    slots = [s for b in plan for s in b.slots]
    assert [s.name for s in slots] == [n for n, _, _ in specs]                    # each once, in order
    assert [(s.shape, s.dtype) for s in slots] == [(tuple(sh), d) for _, sh, d in specs]
    for b in plan:
        assert b.slots and all(s.dtype == b.dtype for s in b.slots)                # one dtype per bucket
        assert b.nbytes <= limit or len(b.slots) == 1                              # only oversize stands alone
        ends = [0] + [s.offset + s.numel for s in b.slots]
        assert [s.offset for s in b.slots] == ends[:-1] and ends[-1] == b.numel   # contiguous offsets
        assert all(s.numel == math.prod(s.shape) for s in b.slots)
    for b, nxt in zip(plan, plan[1:]):  # greedy: a bucket closes only when the next tensor cannot join it
        first = nxt.slots[0].numel * torch.empty((), dtype=nxt.dtype).element_size()
        assert nxt.dtype != b.dtype or b.nbytes + first > limit
    assert plan_from_json(plan_to_json(plan, 7), 7) == plan

    gen = torch.Generator().manual_seed(seed)
    tensors = {n: random_tensor(sh, d, gen) for n, sh, d in specs}
    for b in plan:
        flat = pack_bucket(tensors, b, "cpu")
        assert flat.shape == (b.numel,) and flat.dtype == b.dtype
        out = unpack_bucket(flat, b)
        assert list(out) == [s.name for s in b.slots]
        for name, t in out.items():
            assert t.shape == tensors[name].shape and t.dtype == tensors[name].dtype
            assert torch.equal(as_bytes(t), as_bytes(tensors[name]))              # bit-exact


def test_plan_rejects_bad_limits_and_mismatched_tensors():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (2,), torch.float32)], 0)
    plan = plan_buckets([("a", (2,), torch.float32)], 64)
    with pytest.raises(ValueError, match="a: tensor is"):
        pack_bucket({"a": torch.zeros(3)}, plan[0], "cpu")
    with pytest.raises(RuntimeError, match="version 2"):
        plan_from_json(plan_to_json(plan, 1), 2)


@pytest.mark.parametrize("override,needle", [
    ("ray.weight_sync=nccl", "ray.weight_sync: 'nccl' is not allowed; choose one of ['object_store', 'broadcast']"),
    ("ray.bucket_mb=0", "ray.bucket_mb: must be a positive number of MiB"),
    ("ray.bucket_mb=-3", "ray.bucket_mb: must be a positive number of MiB"),
    ("ray.bucket_mb=.nan", "ray.bucket_mb: must be a positive number of MiB"),
    ("ray.sync_timeout_s=0", "ray.sync_timeout_s: must be a positive number of seconds"),
])
def test_bad_weight_sync_config_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, [override])
    assert needle in str(e.value)


def sample_state_dict(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(12, 6, generator=gen),
            "norm.weight": torch.randn(6, generator=gen).bfloat16(),
            "proj.weight": torch.randn(5, 5, generator=gen).bfloat16(),
            "steps": torch.tensor(seed, dtype=torch.int64),
            "table": torch.randint(-10**12, 10**12, (3, 4), generator=gen),
            "head.weight": torch.randn(30, generator=gen)}


def run_members(world: int, port: int, body, timeout_s: float = 30) -> None:
    """Run `body(rank, group)` for every rank of a fresh gloo group, each rank a thread of this process;
    re-raises a member's error here and fails if a member is stuck."""
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        group = None
        try:
            group = WeightBroadcastGroup("127.0.0.1", port, rank, world, timeout_s=timeout_s,
                                         local_addr="127.0.0.1")
            body(rank, group)
        except BaseException as err:  # noqa: BLE001 (re-raised in the test thread)
            errors.append(err)
        finally:
            if group is not None:
                group.close()

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * timeout_s)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a member is stuck"


def test_three_rank_gloo_broadcast_is_bit_exact_for_two_versions():
    """Rank 0 sends, ranks 1 and 2 receive; each rank is a thread of this process with its own group."""
    port, world, bucket_bytes = free_port(), 3, 64  # 64 bytes: several buckets per version
    versions = {1: sample_state_dict(1), 2: sample_state_dict(2)}
    results: dict[int, dict] = {}

    def body(rank: int, group: WeightBroadcastGroup) -> None:
        for v, sd in versions.items():
            results[(rank, v)] = group.send(sd, v, bucket_bytes) if rank == 0 else group.receive(v)

    run_members(world, port, body)
    for v, sd in versions.items():
        plan = plan_buckets([(n, t.shape, t.dtype) for n, t in sd.items()], bucket_bytes)
        nbytes, buckets, seconds = results[(0, v)]
        assert (nbytes, buckets) == (sum(t.numel() * t.element_size() for t in sd.values()), len(plan))
        assert buckets >= 4 and seconds >= 0
        for rank in (1, 2):
            got = results[(rank, v)]
            assert list(got) == list(sd)
            for name, t in sd.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape
                assert torch.equal(as_bytes(got[name]), as_bytes(t)), (rank, v, name)
            assert state_dict_digest(got) == state_dict_digest(sd)


def test_streaming_receive_hands_over_each_bucket_and_keeps_none_alive():
    """receive(consume=...): every bucket reaches `consume` in plan order, bit-exact, and the previous
    bucket's tensors (and the buffer under them) are gone before the next one is received (checked at
    each bucket's broadcast call on the receiver)."""
    port, world, bucket_bytes = free_port(), 2, 64
    sd = sample_state_dict(3)
    got: dict[str, torch.Tensor] = {}
    order: list[list[str]] = []
    alive_before: list[int] = []
    refs: list = []

    def consume(part):
        refs.clear()
        refs.extend(weakref.ref(t) for t in part.values())
        refs.extend(weakref.ref(t._base) for t in part.values() if t._base is not None)
        order.append(list(part))
        got.update({k: v.clone() for k, v in part.items()})

    def body(rank: int, group: WeightBroadcastGroup) -> None:
        if rank == 0:
            group.send(sd, 1, bucket_bytes)
            return
        receive_bucket = group._broadcast

        def counting_broadcast(flat):
            alive_before.append(sum(r() is not None for r in refs))
            receive_bucket(flat)

        group._broadcast = counting_broadcast
        assert group.receive(1, consume=consume) == {}

    run_members(world, port, body)
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in sd.items()], bucket_bytes)
    assert order == [[s.name for s in b.slots] for b in plan] and len(order) >= 4
    assert alive_before == [0] * len(plan)
    for name, t in sd.items():
        assert torch.equal(as_bytes(got[name]), as_bytes(t)), name


def test_a_member_that_fails_mid_broadcast_fails_the_others_at_once_not_at_the_timeout():
    """Rank 2 drops out after joining (as a crashed process would); ranks 0 and 1 must raise within seconds,
    not after timeout_s (a failed member closes its connections, and so do the members it fails)."""
    port, timeout_s = free_port(), 60
    outcome: dict[int, tuple[str, float]] = {}

    def member(rank: int) -> None:
        group = WeightBroadcastGroup("127.0.0.1", port, rank, 3, timeout_s=timeout_s, local_addr="127.0.0.1")
        start = time.perf_counter()
        try:
            if rank == 2:
                return
            group.send(sample_state_dict(0), 1, 64) if rank == 0 else group.receive(1)
            outcome[rank] = ("ok", time.perf_counter() - start)
        except RuntimeError as err:
            outcome[rank] = (str(err), time.perf_counter() - start)
        finally:
            group.close()

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * timeout_s)
    assert set(outcome) == {0, 1}
    for rank, (message, seconds) in outcome.items():
        assert message != "ok" and seconds < timeout_s / 3, (rank, message, seconds)


def broadcast_trainer(tmp_path, data, name: str, *extra):
    """Two rollout workers (a 3-member group), 1 MiB buckets, one torch thread per actor (2 cores: three
    actors with 2 threads each slow every step several times over), and a reward that differs between
    samples, so the advantages are not all zero and every update really changes the policy."""
    from ebpo.rl.trainer import make_loop

    reward = tmp_path / "parity.py"
    reward.write_text("def score(*, completion, **_):\n    return float(len(completion) % 2)\n")
    return make_loop(make_cfg(tmp_path, data, tmp_path / name, "trainer.tracking=none", "trainer.plots=false",
                              "data.eval=null", "rollout.num_workers=2", "rollout.num_threads=1",
                              f"reward.fns=[{{fn: '{reward}:score'}}]", "ray.weight_sync=broadcast",
                              "ray.bucket_mb=1", "ray.sync_timeout_s=60", *extra))


def digests(trainer) -> tuple[dict, list[dict]]:
    learner = ray.get(trainer.learner.weights_digest())
    return learner, [w.call("weights_digest") for w in trainer.run.cluster.rollout_workers]


def test_broadcast_run_leaves_every_rollout_worker_with_the_learner_weights(ray_local, tmp_path, data):
    trainer = broadcast_trainer(tmp_path, data, "b", "trainer.steps=2")
    try:
        before, _ = digests(trainer)
        history = trainer.fit()
        learner, workers = digests(trainer)
        versions = [w.call("ping") for w in trainer.run.cluster.rollout_workers]
    finally:
        trainer.close()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert all(math.isfinite(v) for v in h.values()), h
        assert h["sync/bytes"] == learner["numel"] * 4  # the tiny model is all fp32
        assert h["sync/buckets"] >= 5                   # 5.3 MiB in 1 MiB buckets
    assert learner != before, "the updates changed the policy"
    assert workers == [learner, learner]
    assert versions == [2, 2]
    assert not trainer.events, trainer.events


def test_killed_rollout_workers_return_with_the_policy_and_the_group_is_re_formed(ray_local, tmp_path, data):
    trainer = broadcast_trainer(tmp_path, data, "k", "trainer.steps=3")
    try:
        trainer.step(1)
        ray.kill(trainer.run.cluster.rollout_workers[0].handle, no_restart=True)
        # The next call restarts the worker; it must come back with version 1 (from the learner), not the base.
        learner_v1, workers = digests(trainer)
        assert workers == [learner_v1, learner_v1]
        m2 = trainer.step(2)  # the restarted worker is no member: object-store sync, then a new group
        ray.kill(trainer.run.cluster.rollout_workers[1].handle, no_restart=True)
        mid = trainer.sync_weights()  # a member died unnoticed: the broadcast fails, the object store carries it
        m3 = trainer.step(3)  # broadcast again, over the group re-formed after that
        learner, workers = digests(trainer)
    finally:
        trainer.close()
    assert [w.restarts for w in trainer.run.cluster.rollout_workers] == [1, 1] and m3["faults/restarts"] == 2.0
    assert any("rollout-0 died" in e for e in trainer.events)
    assert any("restarted since the weight-sync group was formed" in e for e in trainer.events), trainer.events
    assert any("broadcast failed" in e for e in trainer.events), trainer.events
    assert (m2["sync/bytes"], m2["sync/buckets"]) == (0.0, 0.0) == (mid["sync/bytes"], mid["sync/buckets"])
    assert m3["sync/bytes"] > 0 and m3["sync/buckets"] >= 5
    assert all(math.isfinite(v) for v in m3.values())
    assert workers == [learner, learner] and learner != learner_v1
