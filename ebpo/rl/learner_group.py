"""The learner ranks as one object: `LearnerGroup` starts W `LearnerActor`s, forms their torch.distributed
group through Ray (rank 0 publishes its address and a free port) and calls them together.

Every rank must run the same collective calls in the same order, so the group sends each call to all
ranks (`update`, `save`, `load`, `export`, `state_dict_for_sync`, `weight_parts`, `broadcast_weights`,
`weights_digest`)
and answers with rank 0's result; calls that concern only the weight-sync group go to rank 0 alone.
With W = 1 it is a thin wrapper around one actor, and the run is what it was with a single learner actor.
"""
from __future__ import annotations

from typing import Any, Callable

class LearnerRankDied(RuntimeError):
    """A learner rank's actor died (or failed) during a group call; the group's other ranks were stopped,
    since they would wait for it in a collective until the process group's timeout."""


ALL_RANKS = ("update", "save", "load", "export", "state_dict_for_sync", "weight_parts", "broadcast_weights",
             "weights_digest")
RANK_ZERO = ("sync_endpoint", "join_sync_group", "close_sync_group")


class _GroupMethod:
    """`group.NAME.remote(*args)`: the call on every rank (or rank 0), returning rank 0's ObjectRef."""

    def __init__(self, group: "LearnerGroup", name: str):
        self.group, self.name = group, name

    def remote(self, *args, **kwargs):
        targets = self.group.actors if self.name in ALL_RANKS else self.group.actors[:1]
        refs = [getattr(a, self.name).remote(*args, **kwargs) for a in targets]
        self.group.pending.extend(refs[1:])
        return refs[0]


class LearnerGroup:
    """W learner actors forming one process group; `group.update(batch)` etc. block, `group.NAME.remote`
    has the actor-handle calling convention (for the weight-sync driver)."""

    def __init__(self, ray, make_actor: Callable[[int], Any], world_size: int):
        """make_actor(rank) -> a started `LearnerActor` handle (placement chosen by the caller)."""
        self.ray, self.world_size = ray, world_size
        self.actors = [make_actor(rank) for rank in range(world_size)]
        self.pending: list = []  # other ranks' refs of `.remote` calls: checked by `wait_pending`
        if world_size > 1:
            addr, port = ray.get(self.actors[0].rendezvous_endpoint.remote())
            ray.get([a.join_group.remote(addr, port) for a in self.actors])

    def __getattr__(self, name: str) -> _GroupMethod:
        if name in ALL_RANKS or name in RANK_ZERO:
            return _GroupMethod(self, name)
        raise AttributeError(name)

    def call(self, name: str, *args) -> Any:
        """Run `name(*args)` on every rank, wait for all, return rank 0's result. If any rank fails, the
        others are killed at once (they would hang in a collective) and `LearnerRankDied` is raised."""
        self.wait_pending()
        if args and self.world_size > 1:
            args = tuple(self.ray.put(a) if isinstance(a, dict) else a for a in args)  # one copy for all ranks
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

    def update(self, batch: dict) -> dict:
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
