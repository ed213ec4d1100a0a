"""The record of one multi-turn rollout: token ids, which tokens the model generated, turns, tool calls.

What the learner needs is `ids`, `generated` and `segment` (one entry per token, laid out as
`ebpo.core.turns.layout_segments` lays out SFT data: every model turn ends on a block boundary), plus the
rewards; what the reward functions and the tables need is `turns` (text, tool calls, results, errors,
latency). `to_dict()` is the plain-data form (JSON, Ray) that `rewards.trajectory` reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TurnRecord:
    """One model turn and the environment's answer to it.

    start, end: absolute positions of the turn's generated tokens [start, end) (end is a block boundary:
        the last block is kept whole, as decoded); text: the turn as the environment saw it (up to the
        first EOS, special tokens dropped); finished_by: "eos", "tool_call" (a closed call ended it) or
        "budget" (max_turn_tokens or the total budget); forwards: decoder forwards the turn took;
    observation: the environment's text (None when it ended the trajectory); obs_start, obs_end: its
        tokens' positions (the observation template included); reward / done / info: what `step` returned;
        tool_calls: `info["tool_calls"]` when the environment reports them (name, arguments, ok, result,
        error, timeout, latency_s); env_latency_s: wall time of the `step` call; wait_s: time from the turn's
        end to the sequence decoding again; error: why the step failed (exception, timeout, bad return).
    """

    index: int
    start: int
    end: int
    text: str
    finished_by: str
    forwards: int = 0
    observation: str | None = None
    obs_start: int = 0
    obs_end: int = 0
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    tool_calls: list = field(default_factory=list)
    env_latency_s: float = 0.0
    wait_s: float = 0.0
    error: str | None = None


@dataclass
class Trajectory:
    """One multi-turn rollout.

    prompt_ids: the prompt; ids: the whole sequence (prompt, turns with their last block whole,
    observations), length a multiple of the block size; generated: per token, True where the model wrote it;
    segment: per token, 0 = prompt, then 2t+1 for turn t and 2t+2 for its observation;
    stop: "done" (the environment ended it), "max_turns", "max_total_tokens" (the turns spent the budget: not
    even an empty observation would fit), "observation_overflow" (the environment's answer was too long for
    what was left of `max_total_tokens`: recorded in the turn, not appended; the trajectory ends there and
    `error` says how long it was), "env_error" or
    "env_timeout";
    failed: the environment failed (exception, timeout, bad return), counted, never raised;
    error: why it failed, or why it stopped early (observation_overflow);
    env_reward: sum of the environment's step rewards; num_forwards: decoder forwards over all turns;
    wall_s: from the start of the batch to this trajectory's end;
    num_edits / num_deletes / num_inserts: tokens rewritten after being visible (T2T, MBE, DELETE, INSERT) and
    the Levenshtein operations among them, over all turns;
    lev_drafts: for each block in which a DELETE / INSERT ran, (offset of the block's start from the end of
    `prompt_ids`, the block's tokens before its first operation): the pre-edit drafts L-EBPO reads, as in
    `GenerationOutput.lev_drafts`.
    agent: agent RL (`ebpo.serve.gateway`): the agent function's record ({"reward": ...} or the dict it
    returned), None for an environment's trajectory; segments: the episode's earlier segments, ended because
    a request rewrote the history (each a `to_dict()` with stop "rewritten"); this trajectory is the last.
    """

    prompt_ids: list[int]
    ids: list[int]
    generated: list[bool]
    segment: list[int]
    turns: list[TurnRecord]
    stop: str
    failed: bool = False
    error: str | None = None
    env_reward: float = 0.0
    num_forwards: int = 0
    wall_s: float = 0.0
    num_edits: int = 0
    num_deletes: int = 0
    num_inserts: int = 0
    lev_drafts: list = field(default_factory=list)
    agent: dict | None = None
    segments: list = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return sum(self.generated)

    @property
    def tool_calls(self) -> list[dict]:
        return [c for t in self.turns for c in t.tool_calls]

    def metrics(self) -> dict:
        """Per-trajectory numbers the tracker averages: turns, tool calls, tool errors, tool latency, the
        share of environment tokens (context after the prompt that the model did not write)."""
        calls = self.tool_calls
        env_tokens = sum(1 for g, s in zip(self.generated, self.segment) if not g and s > 0)
        return {"turns": len(self.turns), "tool_calls": len(calls),
                "tool_errors": sum(1 for c in calls if not c.get("ok", False)),
                "tool_timeouts": sum(1 for c in calls if c.get("timeout")),
                "tool_latency_s": sum(float(c.get("latency_s", 0.0)) for c in calls),
                "env_latency_s": sum(t.env_latency_s for t in self.turns),
                "env_token_share": env_tokens / max(1, len(self.ids) - len(self.prompt_ids)),
                "failed": float(self.failed), "generated_tokens": self.num_generated,
                "observation_overflow": float(self.stop == "observation_overflow")}

    def to_dict(self) -> dict:
        """Plain data (lists, dicts, str, numbers): what rewards and tables receive."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Trajectory":
        """The inverse of `to_dict` (a rollout worker's plain data back into records)."""
        turns = [TurnRecord(**t) for t in data.get("turns") or []]
        return cls(**{**data, "turns": turns})


def trajectory_text(traj: dict, max_chars: int = 200) -> str:
    """A trajectory (`Trajectory.to_dict()`) as plain text for tables (W&B, `tables/*.jsonl`): one line per
    model turn, then one per tool call (`-> name(arguments) = result` or `!! error`), or the observation
    (`<- text`); a failed environment step as `environment failed: ...`; values cut to `max_chars`."""
    lines = []
    for t in traj.get("turns") or []:
        lines.append(f"[turn {t['index'] + 1}, {t['finished_by']}] {t['text']}")
        for c in t.get("tool_calls") or []:
            value = c.get("result") if c.get("ok") else f"!! {c.get('error')}"
            lines.append(f"  -> {c.get('name')}({c.get('arguments')}) = {str(value)[:max_chars]}")
        if t.get("error"):
            lines.append(f"  environment failed: {str(t['error'])[:max_chars]}")
        elif t.get("observation") is not None and not t.get("tool_calls"):
            lines.append(f"  <- {str(t['observation'])[:max_chars]}")
    if traj.get("stop") == "observation_overflow":
        lines.append(f"  <- (dropped) {str(traj.get('error'))[:max_chars]}")
    lines.append(f"[stop: {traj.get('stop')}, env reward {float(traj.get('env_reward') or 0.0):g}]")
    return "\n".join(lines)


def summarize(trajectories: list[Trajectory]) -> dict:
    """Batch metrics (means over trajectories, `agent/` prefix) plus counts of failures and stop reasons."""
    if not trajectories:
        return {}
    per = [t.metrics() for t in trajectories]
    out = {f"agent/{k}": sum(p[k] for p in per) / len(per) for k in per[0]}
    out["agent/failed_count"] = sum(int(t.failed) for t in trajectories)
    for t in trajectories:
        out[f"agent/stop/{t.stop}"] = out.get(f"agent/stop/{t.stop}", 0) + 1
    return out
