"""The learner ranks as one object: `LearnerGroup` starts W `LearnerActor`s, forms their torch.distributed
group through Ray (rank 0 publishes its address and a free port) and calls them together.

Every rank must run the same collective calls in the same order, so the group sends each call to all
ranks (`update`, `save`, `load`, `export`, `state_dict_for_sync`, `weight_parts`, `broadcast_weights`,
`weights_digest`) and answers with rank 0's result; calls that concern only the weight-sync group
(`sync_endpoint`, `join_sync_group`, `close_sync_group`) go to rank 0 alone. Each is a method here,
named as on `LearnerActor`.
With W = 1 it is a thin wrapper around one actor, and the run is what it was with a single learner actor.
"""
from __future__ import annotations

from typing import Any, Callable

from ebpo.rl.records import LearnerBatch


class LearnerRankDied(RuntimeError):
    """A learner rank's actor died (or failed) during a group call; the group's other ranks were stopped,
    since they would wait for it in a collective until the process group's timeout."""


class LearnerGroup:
    """W learner actors forming one process group. `update`, `save`, `load`, `export` block and raise
    `LearnerRankDied`; the weight-transport calls return rank 0's ObjectRef at once (for
    `ebpo.rl.weights.PolicyWeights`), the other ranks' refs being checked by `wait_pending`."""

    def __init__(self, ray, make_actor: Callable[[int], Any], world_size: int):
        """make_actor(rank) -> a started `LearnerActor` handle (placement chosen by the caller)."""
        self.ray, self.world_size = ray, world_size
        self.actors = [make_actor(rank) for rank in range(world_size)]
        self.pending: list = []  # other ranks' refs of `.remote` calls: checked by `wait_pending`
        if world_size > 1:
            addr, port = ray.get(self.actors[0].rendezvous_endpoint.remote())
            ray.get([a.join_group.remote(addr, port) for a in self.actors])

    def _on_all(self, name: str, *args):
        """`name(*args)` on every rank; rank 0's ObjectRef (the others' are kept for `wait_pending`)."""
        refs = [getattr(a, name).remote(*args) for a in self.actors]
        self.pending.extend(refs[1:])
        return refs[0]

    def _on_rank0(self, name: str, *args):
        return getattr(self.actors[0], name).remote(*args)

    # weight transport: ObjectRefs, every rank joins the gathers (ZeRO-3)
    def weight_parts(self, bucket_bytes: int):
        return self._on_all("weight_parts", bucket_bytes)

    def broadcast_weights(self, version: int, bucket_bytes: int):
        return self._on_all("broadcast_weights", version, bucket_bytes)

    def state_dict_for_sync(self):
        return self._on_all("state_dict_for_sync")

    def weights_digest(self):
        return self._on_all("weights_digest")

    # the weight-sync group: rank 0 alone
    def sync_endpoint(self):
        return self._on_rank0("sync_endpoint")

    def join_sync_group(self, addr: str, port: int, world_size: int, timeout_s: float, device: str = "cpu"):
        return self._on_rank0("join_sync_group", addr, port, world_size, timeout_s, device)

    def close_sync_group(self):
        return self._on_rank0("close_sync_group")

    def call(self, name: str, *args) -> Any:
        """Run `name(*args)` on every rank, wait for all, return rank 0's result. If any rank fails, the
        others are killed at once (they would hang in a collective) and `LearnerRankDied` is raised."""
        self.wait_pending()
        if args and self.world_size > 1:
            # one copy for all ranks
            args = tuple(self.ray.put(a) if isinstance(a, (dict, LearnerBatch)) else a for a in args)
        refs = [getattr(a, name).remote(*args) for a in self.actors]
        waiting = list(refs)
        while waiting:
            done, waiting = self.ray.wait(waiting, num_returns=1)
            try:
                self.ray.get(done)
            except Exception as err:  # noqa: BLE001 (actor death or an exception inside a rank: both end the group)
                self.kill()
                raise LearnerRankDied(f"learner rank {refs.index(done[0])} failed in {name}: {err}") from err
        return self.ray.get(refs[0])

    def kill(self) -> None:
        """Stop every rank (no restart); the group cannot be used afterwards."""
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass

    def update(self, batch: LearnerBatch) -> dict:
        return self.call("update", batch)

    def save(self, path: str) -> None:
        self.call("save", path)

    def load(self, path: str) -> None:
        self.call("load", path)

    def export(self, path: str) -> None:
        self.call("export", path)

    def wait_pending(self) -> None:
        """Raise if a rank failed in an earlier `.remote` call (rank 0's own ref is the caller's to get)."""
        if self.pending:
            refs, self.pending = self.pending, []
            self.ray.get(refs)
