"""Partial rollouts: sequences that outlive an RL step, decoded block by block under the newest weights.

`PartialRollouts.collect` runs one step's worth of decoding: it takes the sequences carried over from earlier
steps (each stopped at a block boundary), the step's new prompts, and the weights of `version`; it decodes
until `quota` prompt groups are complete, then stops every other sequence at its next block boundary
(`Engine.drain`) and keeps it for the next call: in its slot of the worker's long-lived engine, held there
(`Engine.export(keep_slots=True)`), or as host state when the call had an engine of its own. A checkpoint (`state`)
holds the host state, which any engine adopts. Taken back, a sequence recomputes its keys/values under the current
weights either way, so both give the same steps, forwards included (a resumed run's are those of an uninterrupted
one). Each block records the version that decoded it, so the
learner's behaviour term of a block is that version's conditional, exactly (docs/ebpo.md).

What a call returns is decided by the decoding alone (the engine's forwards are a deterministic function of
the sequences, their generators and the weights), not by wall-clock time, so a run with partial rollouts is
as reproducible as one without; with environments, which step a sequence finishes in also depends on how
long its tools take. A sequence whose oldest block is older than `min_version` when a call starts is dropped
with its whole group, and counted. With `due_version`, a call also waits for every group holding a sequence
whose oldest block is older than `due_version` (the groups the next call would drop) and returns it beyond the
quota, so that nothing is dropped: the lag is bounded by waiting for the few overdue groups instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ebpo.core.turns import round_up

from .engine import resident
from .engine_holder import EngineHolder
from .multiturn import TurnDriver
from .sequence import FINISHED, QUEUED, Sequence


@dataclass
class NewSequence:
    """One sequence to start: its prompt ids, its generator (sampling), its group key and, multi-turn, its
    environment (already reset)."""
    prompt: list[int]
    generator: torch.Generator | None
    tag: object
    env: object | None = None


@dataclass
class CollectStats:
    """What one `collect` did: sequences carried into / out of it, dropped for staleness (sequences and
    generated tokens thrown away), and of the returned sequences' generated tokens how many were decoded in
    earlier calls (`carried_tokens`) out of `returned_tokens`."""
    carried_in: int = 0
    carried_out: int = 0
    dropped: int = 0
    dropped_tokens: int = 0
    carried_tokens: int = 0
    returned_tokens: int = 0
    forwards: int = 0


@dataclass
class PartialRollouts:
    """The in-flight state of partial rollouts on one rollout worker (see the module docstring).

    group_sizes: tag -> members submitted; carried: unfinished sequences at block boundaries; done: finished
    sequences whose group is not complete or not yet returned.
    """
    group_sizes: dict = field(default_factory=dict)
    carried: list = field(default_factory=list)
    done: list = field(default_factory=list)
    dropped_tags: set = field(default_factory=set)  # groups the last `collect` dropped for staleness

    def collect(self, model, cfg, new: list[NewSequence], quota: int, version: int, *, max_batch: int,
                min_version: int | None = None, due_version: int | None = None, tokenizer=None, mt=None,
                runner=None, engines=None) -> tuple[list, CollectStats]:
        """Decode until `quota` groups are complete, and every overdue group too; returns (their sequences, the
        first `quota` groups to complete in completion order, then the overdue ones beyond them; a group's members
        in the order they finished; `CollectStats`).

        cfg: the `DecodeConfig`; version: the weights' version (recorded per block); max_batch: slots (0: all
        sequences at once); min_version: drop carried sequences whose oldest block is older; due_version: a group
        holding a sequence whose oldest block is older is overdue (None: none is); mt / tokenizer / runner:
        multi-turn (`rollout.multiturn`); engines: an `EngineHolder` whose long-lived engine decodes the call (a
        rollout worker's): the carried sequences wait between calls in its slots, held at their block boundaries
        (without one, the call's own engine decodes and the carried sequences wait as host state, adopted by the
        next call's engine; the results are the same).
        """
        stats = CollectStats()
        self.dropped_tags = set()
        K = cfg.block_size or model.config.block_size
        slots = max_batch if max_batch > 0 else max(1, len(self.carried) + len(new))  # 0: everything at once
        engine = (engines or EngineHolder(model)).get(cfg, canvas_len=self._canvas_len(cfg, mt, new, K), max_batch=slots)
        self._drop_stale(min_version, stats, K, engine)
        due = self._tags_older_than(due_version)
        for s in new:
            self.group_sizes[s.tag] = self.group_sizes.get(s.tag, 0) + 1
        if engine.version != version:
            engine.set_version(version)  # nothing is decoding: sequences kept here are at block boundaries
        # multi-turn sequences go through their client, the turn driver (environments, observations)
        client = engine if mt is None else TurnDriver(tokenizer=tokenizer, mt=mt, engine=engine, env_runner=runner)
        forwards0 = engine.num_forwards
        before = {id(s): set(s.block_versions) for s in self.carried + self.done}  # decoded in earlier calls
        stats.carried_in = len(self.carried)
        # overdue ones take slots first (the step waits for them), then the active ones; the call's sequences in
        # this order decide which of those finishing in one forward completes its group first
        order = sorted(self.carried, key=lambda s: (s.tag not in due, s.status == QUEUED))
        for s in order:
            client.adopt(s)
        for s in new:
            seq = client.submit(s.prompt, s.generator, env=s.env)
            seq.tag = s.tag
            order.append(seq)
        complete, note_finished = self._complete_groups(order, client, quota, due)
        client.drain()
        note_finished()  # sequences that ended while draining wait in `done` for their group
        # a worker's long-lived engine keeps the unfinished ones in their slots for the next call; a call's own
        # engine lets them go
        self.carried = engine.export(keep_slots=engines is not None)
        engine.forget_finished()
        stats.carried_out = len(self.carried)
        stats.forwards = engine.num_forwards - forwards0
        out = []
        for tag in complete:
            members = [s for s in self.done if s.tag == tag]
            out += members
            del self.group_sizes[tag]
        taken = {id(s) for s in out}
        self.done = [s for s in self.done if id(s) not in taken]
        for s in out:
            n, old = decoded_tokens(s, K, before.get(id(s), set()))
            stats.returned_tokens += n
            stats.carried_tokens += old
        return out, stats

    def _complete_groups(self, order: list, engine, quota: int, due: set = frozenset()):
        """Step `engine` until `quota` groups and every group in `due` are complete (or nothing is left), looking
        at the call's sequences in `order`;
        returns the first `quota` completed groups' tags in completion order followed by the `due` ones beyond
        them, and the function that moves newly finished sequences to `self.done` (call it again after
        draining)."""
        counted: set[int] = set()
        complete: list = []
        counts: dict = {}
        for s in self.done:  # finished in an earlier call, their group still incomplete or not yet returned
            counts[s.tag] = counts.get(s.tag, 0) + 1
        for tag, n in counts.items():
            if n == self.group_sizes.get(tag):
                complete.append(tag)
        waiting = set(due) - set(complete)  # overdue groups not yet complete

        def enough() -> bool:
            for s in order:
                if s.status == FINISHED and id(s) not in counted:
                    counted.add(id(s))
                    self.done.append(s)
                    counts[s.tag] = counts.get(s.tag, 0) + 1
                    if counts[s.tag] == self.group_sizes[s.tag]:
                        complete.append(s.tag)
                        waiting.discard(s.tag)
            return len(complete) >= quota and not waiting

        engine.run_until(enough)
        enough()
        return complete[:quota] + [t for t in complete[quota:] if t in due], enough

    def _tags_older_than(self, version: int | None) -> set:
        """Groups holding a carried or finished sequence whose oldest block is older than `version`."""
        if version is None:
            return set()
        return {s.tag for s in self.carried + self.done
                if s.oldest_version() is not None and s.oldest_version() < version}

    def _drop_stale(self, min_version: int | None, stats: CollectStats, K: int, engine) -> None:
        """Drop (and count) every group holding a sequence whose oldest block is older than `min_version`; those
        `engine` holds in their slots leave them."""
        if min_version is None:
            return
        stale = self._tags_older_than(min_version)
        self.dropped_tags = stale
        for s in self.carried + self.done:
            if s.tag in stale:
                stats.dropped += 1
                stats.dropped_tokens += decoded_tokens(s, K)[0]
                close_env(s.env)
                if resident(engine, s):
                    engine.end(s, "dropped")
        self.carried = [s for s in self.carried if s.tag not in stale]
        self.done = [s for s in self.done if s.tag not in stale]
        for tag in stale:
            self.group_sizes.pop(tag, None)

    def _canvas_len(self, cfg, mt, new: list[NewSequence], K: int) -> int:
        prompts = [len(s.prompt) for s in new] + [s.prompt_len for s in self.carried]
        if mt is not None:
            return round_up(max([mt.max_total_tokens] + [p + K for p in prompts]), K)
        return round_up(max([p + cfg.max_new_tokens for p in prompts] + [K]), K)

    def state(self) -> dict:
        """Everything needed to continue (a checkpoint): picklable when the environments are."""
        return {"group_sizes": dict(self.group_sizes), "carried": list(self.carried), "done": list(self.done)}

    @classmethod
    def from_state(cls, state: dict) -> "PartialRollouts":
        return cls(group_sizes=dict(state["group_sizes"]), carried=list(state["carried"]), done=list(state["done"]))


def decoded_tokens(s: Sequence, K: int, old_blocks: set = frozenset()) -> tuple[int, int]:
    """(generated positions in the blocks the sequence decoded, of them those in `old_blocks`)."""
    n = old = 0
    for b in s.block_versions:
        for i in range(b * K, (b + 1) * K):
            mine = (s.generated[i] if s.env is not None and i < len(s.generated)
                    else s.prompt_len <= i < s.prompt_len + s.max_new)
            n += mine
            old += mine and b in old_blocks
    return n, old


def close_env(env) -> None:
    """`env.close()` when the environment has one; a failing close is ignored (it must not lose the step)."""
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - a failing close must not lose the step
            pass
