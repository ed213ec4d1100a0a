"""Multi-turn (agentic) rollouts: decode a turn, let the environment answer, decode the next turn.

`generate_multiturn(model, prompts, envs, ...)` submits one sequence per prompt, with its environment, to the
rollout engine (`rollout.engine`: the same loop, the same draft-and-edit steps, DELETE / INSERT, Multi-Block
Editing and compiled step as single-turn decoding). A turn ends when a finished block holds EOS or a closed
`</tool_call>`, or when its token budget is spent. Then:

* the turn's text goes to `env.step` in a daemon thread (`rollout.env_steps`), and the sequence *waits*; the
  other sequences keep decoding (`continue_ready=True`) and queued ones take free slots; when the step
  returns, the sequence rejoins the batch at the next forward. With `continue_ready=False` the whole batch
  pauses while any sequence waits (the pending steps still run concurrently): the baseline `ebpo bench agent`
  compares against;
* the environment's observation is wrapped in `observation_template` and tokenised alone: the turn's
  generated ids stay exactly as decoded (re-tokenising the concatenated text would not give them back),
  and the observation starts at the next block boundary after the turn (`ebpo.core.turns`: no block holds
  a model turn together with what came after it, so the likelihood sees no leaked future). The cached
  keys/values of the turn stay valid: the prefix never changes, the observation is appended;
* the sequence's next turn starts right after the observation (it may share the observation's last block,
  as a prompt's last partial block). Multi-Block Editing revises only the current turn's blocks: a turn
  already sent to the environment is never rewritten (the environment acted on that text).

Limits: `max_turns`, `max_turn_tokens`, `max_total_tokens`, and `step_timeout_s` on every `env.step`, counted
from that step's submission (tools have their own per-call timeout inside the environment,
`rewards.envs.tools`). An environment that raises, hangs past the timeout or returns garbage ends its
trajectory as failed (recorded, counted); the batch goes on, and the process can exit with the hung call
still running.

This module knows environments only by duck typing (`reset`, `step`), so rollout keeps its import floor.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ebpo.core.fields import doc
from ebpo.core.turns import OBSERVATION_TEMPLATE, round_up

from .config import DecodeConfig
from .decoder import _make_generators
from .engine import Engine
from .trajectory import Trajectory


@dataclass
class MultiTurnConfig:
    max_turns: int = doc("most model turns per trajectory", 4)
    max_turn_tokens: int = doc("most new tokens per model turn (its blocks are decoded whole)", 96)
    max_total_tokens: int = doc("most tokens per trajectory: prompt, turns, observations", 512)
    step_timeout_s: float = doc("wall-clock limit of one env.step; past it the trajectory fails", 30.0)
    continue_ready: bool = doc("sequences that are ready keep decoding while others wait on their tools; "
                               "False: the batch pauses while any sequence waits (its pending steps still run "
                               "concurrently), the baseline of `ebpo bench agent`", True)
    stop_at_tool_call: bool = doc("a finished block holding a closed </tool_call> ends the turn", True)
    observation_template: str = doc("text around an observation; {observation} is replaced", OBSERVATION_TEMPLATE)
    max_workers: int = doc("threads running env.step calls at once", 16)

    def validate(self) -> None:
        if self.max_turns < 1 or self.max_turn_tokens < 1 or self.max_total_tokens < 1:
            raise ValueError("multiturn: max_turns, max_turn_tokens and max_total_tokens must be >= 1")
        if "{observation}" not in self.observation_template:
            raise ValueError("multiturn.observation_template must contain {observation}")


@torch.no_grad()
def generate_multiturn(model, prompts: list[list[int]], envs: list, config: DecodeConfig | None = None,
                       mt: MultiTurnConfig | None = None, *, tokenizer, seeds: list[int] | None = None,
                       on_turn=None, max_batch: int | None = None) -> list[Trajectory]:
    """Multi-turn rollouts of `prompts` (token-id lists) against `envs` (one environment per prompt, already
    `reset`); returns one `Trajectory` per prompt. `on_turn(seq, TurnRecord)` is called after every step.

    config: the decoding options; its max_new_tokens is unused (`mt.max_turn_tokens` bounds a turn).
    seeds: one per prompt (temperature > 0). max_batch: most trajectories decoding at once (default
    `config.max_batch`; 0 = all); a finished trajectory's slot takes the next prompt.
    """
    cfg = config or DecodeConfig.preset("quality")
    mt = mt or MultiTurnConfig()
    mt.validate()
    if len(envs) != len(prompts):
        raise ValueError(f"generate_multiturn: one environment per prompt ({len(prompts)}), got {len(envs)}")
    K = cfg.block_size or model.config.block_size
    dev = next(model.parameters()).device
    gens = _make_generators(len(prompts), seeds, None, cfg.temperature, dev)
    T = round_up(max(mt.max_total_tokens, max(len(p) for p in prompts) + K), K)
    limit = max_batch if max_batch is not None else cfg.max_batch
    engine = Engine(model, cfg, max_batch=min(limit or len(prompts), len(prompts)), canvas_len=T,
                    tokenizer=tokenizer, mt=mt, on_turn=on_turn)
    for i, (p, env) in enumerate(zip(prompts, envs)):
        engine.submit(p, None if gens is None else gens[i], env=env)
    return [trajectory_of(s, engine.t0, K) for s in engine.run()]


def trajectory_of(s, t0: float, K: int) -> Trajectory:
    """The `Trajectory` of a finished multi-turn engine `Sequence` (t0: the engine's start, monotonic seconds;
    K: the block size)."""
    L = s.length
    return Trajectory(prompt_ids=list(s.prompt), ids=s.canvas[:L], generated=s.generated[:L], segment=s.segment[:L],
                      turns=s.turns, stop=s.stop or "done", failed=s.failed, error=s.error,
                      env_reward=sum(t.reward for t in s.turns), num_forwards=s.forwards,
                      wall_s=(s.end_time or time.monotonic()) - t0, num_edits=s.edits, num_deletes=s.deletes,
                      num_inserts=s.inserts,
                      lev_drafts=[(b * K - s.prompt_len, d) for b, d in sorted(s.lev_drafts.items())])


def start_episodes(envs: list, rows: list[dict], prompts: list[list[int]], tokenizer, seeds: list[int] | None = None,
                   template: str = OBSERVATION_TEMPLATE) -> list[list[int]]:
    """`env.reset(row, seed)` for every environment; an initial observation is appended to its prompt
    (wrapped in `template`). Returns the prompts to decode."""
    out = []
    for i, (env, row, p) in enumerate(zip(envs, rows, prompts)):
        obs = env.reset(row, None if seeds is None else seeds[i])
        extra = tokenizer(template.format(observation=obs), add_special_tokens=False)["input_ids"] if obs else []
        out.append(list(p) + extra)
    return out


def run_episodes(model, prompts: list[list[int]], rows: list[dict], env_factory, config: DecodeConfig | None = None,
                 mt: MultiTurnConfig | None = None, *, tokenizer, seeds: list[int] | None = None,
                 max_batch: int | None = None) -> list[Trajectory]:
    """One batch of episodes: a fresh environment per prompt from `env_factory()`, reset with its row and seed
    (`start_episodes`), decoded (`generate_multiturn`), then closed (a failing `close` is ignored: it must
    not lose the batch). prompts: token-id lists, one per row; seeds: one per prompt (also the sampling
    seeds when config.temperature > 0)."""
    mt = mt or MultiTurnConfig()
    envs = [env_factory() for _ in prompts]
    try:
        starts = start_episodes(envs, rows, prompts, tokenizer, seeds, mt.observation_template)
        return generate_multiturn(model, starts, envs, config, mt, tokenizer=tokenizer, seeds=seeds,
                                  max_batch=max_batch)
    finally:
        for env in envs:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass
