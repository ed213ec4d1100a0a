"""The one owner of the policy's weight versions and of their transport, learner -> rollout workers
(systems code, no algorithm); both RL loops use it.

Version v is the learner's weights after its v-th publication (0 = the initial policy). Synchronous loop:
`sync()` makes the next version and brings every rollout worker to it. Asynchronous loop: `publish()` makes
the next version and puts it into the object store, bucketed as a sync does, without loading it anywhere;
`holding(weights)` loads a given version into the rollout workers (unless they hold it) and keeps it there
while the caller generates. A (re)started rollout worker starts from `restart_weights()`.

`ray.weight_sync=object_store`: the learner puts its weights into the Ray object store once, one part per
bucket of `ray.bucket_mb` as it gathers them (`rollout.weight_sync.WeightParts`), and every rollout worker
loads them part by part. `ray.weight_sync=broadcast`: a bucketed broadcast over a standalone gloo/NCCL
group (`rollout.weight_sync`) with the learner as rank 0; a worker restarted since the group was formed,
a failed broadcast or a group that cannot form makes that sync use the object store and re-forms the
group, and after `MAX_BROADCAST_FAILURES` failures in a row the run stays on the object store.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional


class Weights(NamedTuple):
    """One weight version: its number and an object-store reference to it (`rollout.weight_sync.WeightParts`)."""
    version: int
    ref: Any


def brief(err: BaseException) -> str:
    """`Type: first line` of an error, unwrapping a Ray task error to the exception raised in the actor."""
    cause = getattr(err, "cause", None) or err
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0][:300] if lines else ''}"


class PolicyWeights:
    """Keeps the rollout workers on the learner's weights; `version` counts the versions made.

    ray: the `ray` module. ray_cfg: the recipe's `ray` section (`weight_sync`, `bucket_mb`, `sync_timeout_s`,
    `learner_gpus`, `rollout_gpus`). event: logs one line to the run's event list.
    `attach(learner, rollout_workers)` must be called once the actors exist (workers are
    `ebpo.rl.actors.ResilientActor`s, the learner a `LearnerActor` handle)."""

    MAX_BROADCAST_FAILURES = 3  # broadcast failures in a row before the run stays on the object store

    def __init__(self, ray, ray_cfg, event: Callable[[str], None]):
        self.ray, self.cfg, self._event = ray, ray_cfg, event
        self.version = 0
        self._latest = None  # object-store reference of the last synced version (None: ask the learner)
        self.published: Optional[Weights] = None  # asynchronous loop: the newest version, not yet loaded
        self._held: Optional[Weights] = None  # the version `holding` loaded into the rollout workers
        self._lock = threading.Lock()  # load + generate together (the asynchronous producer thread, eval)
        self.learner = None
        self.rollout_workers: list = []
        # each rollout worker's `restarts` when the group was formed (None: no group), and broadcast
        # failures in a row
        self.group_restarts: list[int] | None = None
        self.broadcast_failures = 0

    def attach(self, learner, rollout_workers: list) -> None:
        """Start syncing to these actors; with broadcast, forms the group (all of them must be alive)."""
        self.learner, self.rollout_workers = learner, rollout_workers
        if self.cfg.weight_sync == "broadcast":
            self._form_group()

    def detach(self) -> None:
        """The learner died: forget every reference its rank 0 owned (they died with it) and close the
        broadcast group; `attach` the new learner next."""
        self._latest, self.published, self._held = None, None, None
        if self.cfg.weight_sync == "broadcast":
            self.close_group()

    def restart_weights(self) -> dict:
        """Keyword arguments `weights`, `weights_version` of a (re)started rollout worker: the version
        `holding` loaded (so retried work samples exactly what the lost work would have), else None (the base
        model) before the first sync, else the last synced policy (an ObjectRef, resolved by Ray when the
        actor is created)."""
        if self._held is not None:
            return {"weights": self._held.ref, "weights_version": self._held.version}
        return {"weights": self._synced_weights(), "weights_version": self.version}

    def _synced_weights(self):
        if self.cfg.weight_sync == "object_store" or self.version == 0:
            return self._latest
        # Broadcast mode keeps no copy in the object store, so ask the learner. Its weights equal the last
        # synced ones here: a sync runs right after every learner update, and a worker is only (re)started
        # outside that pair -- during rollout, reward or evaluation, or inside the sync itself, whose version
        # is the learner's current weights. The learner runs calls in order, so this read comes after any
        # update already submitted.
        return self.learner.weight_parts(self._bucket_bytes())

    def _bucket_bytes(self) -> int:
        return max(1, int(self.cfg.bucket_mb * 2**20))

    def sync(self, new_version: bool = True) -> dict[str, float]:
        """Synchronous loop: bring every rollout worker to the learner's weights as version + 1 (new_version
        False: as the current version, after a resume: the learner restored that version's weights); returns
        sync/* metrics (broadcast mode only: bytes and buckets broadcast, both 0 when that sync fell back)."""
        self.version += int(new_version)
        if self.cfg.weight_sync == "object_store":
            self._by_object_store()
            return {}
        if self.broadcast_failures >= self.MAX_BROADCAST_FAILURES:
            self._by_object_store()
            self._latest = None  # restarted workers ask the learner (see restart_weights)
            return {"sync/bytes": 0.0, "sync/buckets": 0.0}
        return self._by_broadcast()

    def current(self) -> Weights:
        """The learner's weights now, as the current version, in the object store (bucketed)."""
        self.published = Weights(self.version, self.learner.weight_parts(self._bucket_bytes()))
        return self.published

    def publish(self) -> Weights:
        """Asynchronous loop: the learner's new weights as version + 1 in the object store, bucketed as
        a sync puts them; the rollout workers load them when a step asks for them (`holding`)."""
        self.version += 1
        return self.current()

    @contextmanager
    def holding(self, weights: Optional[Weights]) -> Iterator[None]:
        """Within the block the rollout workers hold `weights` (loaded first unless they hold that version;
        None = whatever they hold) and nobody else loads another version."""
        with self._lock:
            if weights is not None and (self._held is None or self._held.version != weights.version):
                self._held = weights  # before the loads: a worker restarted meanwhile gets them too
                self._load_all(weights.ref, weights.version)
            yield

    def state(self) -> dict:
        """What a checkpoint records: the version number."""
        return {"version": self.version}

    def restore(self, state: dict) -> None:
        self.version = int(state["version"])

    def reset(self) -> None:
        """Back to the initial policy's version (a learner rebuilt without a checkpoint)."""
        self.version = 0

    def close_group(self) -> None:
        """Close the group on every member; a restarted worker has none, a dead one cannot answer."""
        refs = [self.learner.close_sync_group()] + [w.handle.close_sync_group.remote()
                                                            for w in self.rollout_workers]
        self.ray.wait(refs, num_returns=len(refs), timeout=60)
        self.group_restarts = None

    # ------------------------------------------------------------------------------------------------ internals
    def _by_object_store(self) -> None:
        self._latest = self.learner.weight_parts(self._bucket_bytes())
        self._load_all(self._latest, self.version)

    def _load_all(self, ref, version: int) -> None:
        tickets = [w.submit("load_weights", ref, version) for w in self.rollout_workers]
        for w, t in zip(self.rollout_workers, tickets):
            w.result(t)

    def _by_broadcast(self) -> dict[str, float]:
        """One bucketed broadcast, learner -> all rollout workers. A worker restarted since the group was
        formed is not a member, and a failed broadcast leaves members in unknown states: both fall back to
        the object store for this sync and re-form the group on a new port."""
        if self.group_restarts is None:
            return self._fall_back("no weight-sync group")
        if self.group_restarts != [w.restarts for w in self.rollout_workers]:
            return self._fall_back("a rollout worker was restarted since the weight-sync group was formed")
        send = self.learner.broadcast_weights(self.version, self._bucket_bytes())
        receives = [w.handle.receive_weights.remote(self.version) for w in self.rollout_workers]
        try:
            stats = self._get_all([send, *receives])[0]
        except Exception as err:  # noqa: BLE001 (actor death, gloo/NCCL error or timeout: all handled alike)
            self.broadcast_failures += 1
            return self._fall_back(f"broadcast failed ({brief(err)})")
        self.broadcast_failures = 0
        return {"sync/bytes": float(stats["bytes"]), "sync/buckets": float(stats["buckets"])}

    def _get_all(self, refs: list) -> list:
        """Wait until every call has finished (so no member is still inside a collective), then return their
        results or raise the first error. Each wait inside the group is bounded by ray.sync_timeout_s."""
        self.ray.wait(refs, num_returns=len(refs))
        results, errors = [], []
        for ref in refs:
            try:
                results.append(self.ray.get(ref))
            except Exception as err:  # noqa: BLE001
                errors.append(err)
        if errors:
            raise errors[0]
        return results

    def _fall_back(self, reason: str) -> dict[str, float]:
        self._event(f"weight sync v{self.version}: {reason}; using the object store for this sync and "
                    "re-forming the broadcast group")
        self._by_object_store()  # restarts any dead rollout worker (ResilientActor) with these weights
        self._latest = None  # restarted workers ask the learner (see restart_weights)
        self._form_group()
        return {"sync/bytes": 0.0, "sync/buckets": 0.0}

    def _form_group(self) -> None:
        """(Re-)form the group: learner rank 0, rollout worker i rank i + 1, on a fresh port. All joins are
        submitted at once: the learner's TCPStore and the backend wait for every member."""
        rc = self.cfg
        self.close_group()
        if self.broadcast_failures >= self.MAX_BROADCAST_FAILURES:
            self._event(f"weight sync: {self.broadcast_failures} broadcast failures in a row; the object store "
                        "carries the weights for the rest of the run")
            return
        for w, t in [(w, w.submit("ping")) for w in self.rollout_workers]:
            w.result(t)  # a dead worker would stall every join until the timeout: restart it first
        n = len(self.rollout_workers) + 1
        # NCCL only when every member holds a whole GPU: fractional GPUs may share a device, which NCCL refuses.
        device = "cuda" if rc.learner_gpus >= 1 and rc.rollout_gpus >= 1 else "cpu"
        try:
            addr, port = self.ray.get(self.learner.sync_endpoint())
            joins = [self.learner.join_sync_group(addr, port, n, rc.sync_timeout_s, device)]
            joins += [w.handle.join_sync_group.remote(addr, port, i + 1, n, rc.sync_timeout_s, device)
                      for i, w in enumerate(self.rollout_workers)]
            self._get_all(joins)
        except Exception as err:  # noqa: BLE001
            self.broadcast_failures += 1
            self._event(f"weight sync: could not form the broadcast group ({brief(err)}); the next sync uses "
                        "the object store and tries again")
            return
        self.group_restarts = [w.restarts for w in self.rollout_workers]
