"""One sequence of the rollout engine: a small state machine and the counters it reports.

    QUEUED --admit--> DECODING (block b) --block ends--> DECODING (block b+1)
                         |   ^                  \\--> MBE (window passes) --> DECODING / WAITING / FINISHED
                         |   '---- observation appended ----.
                         '--turn ends--> WAITING (env.step) -'--> FINISHED (done, limits, env failure)

A sequence holds a slot (a row of the engine's canvas and KV cache) from admission to FINISHED; its tokens
are copied out of the slot when it finishes, so the slot can take the next queued sequence at once. The
prompt-like boundary `start` is the first position the current turn may write: the prompt's end for a
single-turn rollout, the end of the last observation for a later turn. Everything before it is context:
never filled, never edited, never moved by DELETE / INSERT, never rewritten by Multi-Block Editing.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

QUEUED, DECODING, MBE, WAITING, FINISHED = "queued", "decoding", "mbe", "waiting", "finished"


@dataclass
class Sequence:
    """Host-side state of one sequence (positions are absolute canvas indices)."""

    id: int  # index in the caller's list (what on_step / on_turn report)
    prompt: list[int]
    generator: torch.Generator | None = None
    env: object | None = None  # an environment (reset/step) for a multi-turn rollout; None: single-turn
    max_new: int = 0  # single-turn: generated positions after the prompt (DecodeConfig.max_new_tokens by default)
    cfg: object = None  # its `DecodeConfig` (requests with different settings share one engine and its forwards)
    status: str = QUEUED
    slot: int | None = None
    start: int = 0  # first writable position of the current turn
    block: int = 0  # active block index
    first_block: int = 0  # the current turn's first block (MBE never reaches before it)
    num_blocks: int = 0  # the current turn may decode blocks [first_block, num_blocks)
    forwards: int = 0
    edits: int = 0
    mbe_edits: int = 0
    deletes: int = 0
    inserts: int = 0
    edit_log: list = field(default_factory=list)  # (offset from the prompt's end, old, new) of every rewrite
    lev_drafts: dict = field(default_factory=dict)  # block -> its tokens before its first DELETE / INSERT
    mbe_start: int | None = None  # first block of the MBE window while MBE passes run
    mbe_passes: int = 0
    mbe_first_changed: int | None = None
    # multi-turn
    turns: list = field(default_factory=list)
    turn_forwards: int = 0
    length: int = 0  # tokens so far whose values are final (prompt, finished turns, observations)
    future: concurrent.futures.Future | None = None
    submitted: float = 0.0
    stop: str = ""
    failed: bool = False
    error: str | None = None
    end_time: float = 0.0
    generated: list[bool] = field(default_factory=list)
    segment: list[int] = field(default_factory=list)
    # weight versions (partial rollouts): block -> the engine version of the block's first forward; the engine
    # changes weights only when every row is at a block boundary, so each block is decoded under one version
    block_versions: dict = field(default_factory=dict)
    tag: object = None  # the caller's key for the sequence (partial rollouts: its prompt group)
    prefix_source: object = None  # a live sequence with the same prompt blocks whose keys/values it will copy
    turn_rule: object = None  # multi-turn: the client's rule, tokens of the turn -> (reason it is over or None, text)
    pause: tuple | None = None  # (reason, text) of the turn that paused the sequence (WAITING) for its client
    # kept in its slot between calls at a block boundary (`Engine.export(keep_slots=True)`): no forward moves it
    # until its client takes it back (`Engine.adopt`)
    held: bool = False
    # copied out of the slot when the sequence finishes (or is exported at a block boundary)
    canvas: list[int] = field(default_factory=list)
    trace: list[int] = field(default_factory=list)

    def __getstate__(self) -> dict:
        """Picklable (partial rollouts' checkpoints): a pending environment step is waited for and kept as
        its outcome; the environment itself must pickle."""
        state = dict(self.__dict__)
        state["turn_rule"] = None  # the client's (it holds a tokenizer): the adopting driver sets its own
        fut = state.pop("future", None)
        if fut is not None:
            try:
                state["_step_outcome"] = ("ok", fut.result())
            except BaseException as e:  # noqa: BLE001 - the failure belongs to this trajectory, kept as it is
                state["_step_outcome"] = ("error", e)
        return state

    def __setstate__(self, state: dict) -> None:
        outcome = state.pop("_step_outcome", None)
        self.__dict__.update(state)
        self.future = None
        if outcome is not None:
            self.future = concurrent.futures.Future()
            self.future.set_running_or_notify_cancel()
            if outcome[0] == "ok":
                self.future.set_result(outcome[1])
            else:
                self.future.set_exception(outcome[1])

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def ready(self) -> bool:
        """Takes part in the next forward."""
        return self.status in (DECODING, MBE) and not self.held

    @property
    def at_block_boundary(self) -> bool:
        """No forward of the active block has run yet (or the sequence waits on its environment): weights may
        change here without mixing two versions inside one block."""
        return self.status == WAITING or (self.status == DECODING and self.mbe_start is None
                                          and self.block not in self.block_versions)

    def oldest_version(self) -> int | None:
        """The weight version of the earliest decoded block (None before any forward)."""
        return min(self.block_versions.values()) if self.block_versions else None

    def versions_by_block(self) -> list[int]:
        """Per absolute block index 0 .. last decoded block: the version that decoded it, -1 for blocks no
        forward decoded (the prompt's whole blocks, a multi-turn row's observation-only blocks)."""
        if not self.block_versions:
            return []
        out = [-1] * (max(self.block_versions) + 1)
        for b, v in self.block_versions.items():
            out[b] = int(v)
        return out

    def new_block(self, block: int) -> None:
        self.block = block
        self.mbe_start, self.mbe_passes, self.mbe_first_changed = None, 0, None
        self.status = DECODING
