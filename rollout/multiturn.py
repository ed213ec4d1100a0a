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

import concurrent.futures
import sys
import time
from dataclasses import dataclass

import torch

from ebpo.core.fields import doc
from ebpo.core.turns import OBSERVATION_TEMPLATE, TOOL_CALL_CLOSE, round_up

from .config import DecodeConfig
from .decoder import _make_generators
from .engine import Engine
from .engine_holder import EngineHolder
from .env_steps import StepRunner, unpack_step
from .sequence import FINISHED, WAITING
from .steps import first_eos
from .trajectory import Trajectory, TurnRecord


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
                       on_turn=None, max_batch: int | None = None, engines=None) -> list[Trajectory]:
    """Multi-turn rollouts of `prompts` (token-id lists) against `envs` (one environment per prompt, already
    `reset`); returns one `Trajectory` per prompt. `on_turn(seq, TurnRecord)` is called after every step.

    config: the decoding options; its max_new_tokens is unused (`mt.max_turn_tokens` bounds a turn).
    seeds: one per prompt (temperature > 0). max_batch: most trajectories decoding at once (default
    `config.max_batch`; 0 = all); a finished trajectory's slot takes the next prompt. engines: an `EngineHolder`
    whose long-lived engine decodes the call (a rollout worker's); default a fresh one.
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
    engine = (engines or EngineHolder(model)).get(cfg, canvas_len=T, max_batch=min(limit or len(prompts), len(prompts)))
    driver = TurnDriver(tokenizer=tokenizer, mt=mt, engine=engine, on_turn=on_turn)
    t0 = time.monotonic()
    seqs = [driver.submit(p, None if gens is None else gens[i], env=env) for i, (p, env) in enumerate(zip(prompts, envs))]
    driver.run()
    engine.forget_finished()
    return [trajectory_of(s, t0, K) for s in seqs]


class TurnRule:
    """When a multi-turn sequence's turn is over (called by the engine with the turn's tokens when a block ends):
    ("eos", text) once the turn holds EOS (the text stops before it), ("tool_call", text) once it holds a closed
    `</tool_call>` (with `stop_at_tool_call`), else (None, text). The engine adds the budget rule itself."""

    def __init__(self, tokenizer, eos_ids: set[int], stop_at_tool_call: bool):
        self.tokenizer, self.eos_ids, self.stop_at_tool_call = tokenizer, eos_ids, stop_at_tool_call

    def __call__(self, tokens: list[int]) -> tuple[str | None, str]:
        cut = first_eos(tokens, self.eos_ids)
        text = self.tokenizer.decode(tokens if cut is None else tokens[:cut], skip_special_tokens=True)
        if cut is not None:
            return "eos", text
        if self.stop_at_tool_call and TOOL_CALL_CLOSE in text:
            return "tool_call", text
        return None, text


class TurnDriver:
    """The multi-turn client of one rollout engine: it submits each trajectory's sequence with a `TurnRule`,
    sends every finished turn's text to its environment's `env.step` (in a `StepRunner` thread; an environment
    with `step_async(text)`, which returns a future of ((observation, reward, done, info), seconds) itself, takes
    no thread), and when the step returns appends the observation with `Engine.extend` or ends the trajectory
    (`Engine.end`) by the limits of `MultiTurnConfig`. The engine itself never sees an environment or a
    tokenizer.

    Either give an `engine`, or the arguments of one (model, cfg, max_batch, canvas_len, version, progress);
    tokenizer: encodes observations and decodes turns; env_runner: the `StepRunner` (default one of
    `mt.max_workers` threads); on_turn(seq id, TurnRecord) after every environment step.
    """

    def __init__(self, model=None, cfg=None, *, tokenizer, mt: MultiTurnConfig, engine: Engine | None = None,
                 env_runner: StepRunner | None = None, on_turn=None, **engine_kw):
        self.engine = engine if engine is not None else Engine(model, cfg, **engine_kw)
        self.tokenizer, self.mt, self.on_turn = tokenizer, mt, on_turn
        self.rule = TurnRule(tokenizer, self.engine.eos_ids, mt.stop_at_tool_call)
        self.env_runner = env_runner or StepRunner(mt.max_workers)
        self.waiting: list = []  # sequences whose turn's env.step is pending

    @property
    def sequences(self) -> list:
        return self.engine.sequences

    def turn_end_block(self, start: int) -> int:
        """The block (exclusive) where a turn starting at `start` must end: its token budget, the trajectory's,
        the canvas."""
        K = self.engine.K
        return min(round_up(start + self.mt.max_turn_tokens, K), round_up(_budget(self), K), self.engine.T) // K

    def submit(self, prompt: list[int], generator=None, env=None):
        """Start one trajectory (its environment already reset); returns its engine `Sequence`."""
        e, P = self.engine, len(prompt)
        room = self.turn_end_block(P) * e.K - P
        s = e.submit(prompt, generator, env=env, max_new_tokens=max(room, 1), turn_rule=self.rule)
        s.generated, s.segment = [False] * e.T, [0] * P + [-1] * (e.T - P)
        if P >= _budget(self):
            e.end(s, "max_total_tokens")
        return s

    def adopt(self, s):
        """Continue a trajectory exported by another engine (partial rollouts)."""
        s.turn_rule = self.rule
        self.engine.adopt(s)
        if s.status == WAITING:
            self.waiting.append(s)
        return s

    def run(self, until=None) -> list:
        """Step until every trajectory is finished, or `until()` is true (when given); returns their sequences
        in submission order."""
        while not (until is not None and until()) and self.step():
            pass
        if self.engine.progress and until is None:
            print(file=sys.stderr)
        return self.engine.sequences

    run_until = run

    def step(self) -> bool:
        """Poll the pending environment steps, run one engine step (none while a trajectory waits, with
        `continue_ready=False`), hand finished turns to their environments. False when nothing is left."""
        self._poll()
        moved = False
        if self.mt.continue_ready or not self.waiting:
            moved = self.engine.step()
        self._send_turns()
        if moved:
            return True
        if self.waiting:
            concurrent.futures.wait([s.future for s in self.waiting], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            return True
        return False

    def drain(self) -> None:
        """`Engine.drain`, then the turns that ended while draining go to their environments (a sequence is
        exported waiting on its step, never with an unsent turn)."""
        self.engine.drain()
        self._send_turns()

    def _send_turns(self) -> None:
        while self.engine.paused:
            self._send_turn(self.engine.paused.popleft())

    def _send_turn(self, s) -> None:
        finished_by, text = s.pause
        tag = 2 * len(s.turns) + 1
        for i in range(s.start, s.length):
            s.generated[i], s.segment[i] = True, tag
        s.turns.append(TurnRecord(index=len(s.turns), start=s.start, end=s.length, text=text, finished_by=finished_by,
                                  forwards=s.turn_forwards))
        s.turn_forwards = 0
        s.submitted = time.monotonic()
        # an environment that answers without blocking (the agent gateway) hands back its own future
        step_async = getattr(s.env, "step_async", None)
        s.future = step_async(text) if step_async is not None else self.env_runner.submit(s.env, text)
        self.waiting.append(s)

    def _poll(self) -> None:
        for s in list(self.waiting):
            if s.status == FINISHED:  # ended by its client meanwhile
                self.waiting.remove(s)
            else:
                self._rejoin(s)

    def _rejoin(self, s) -> None:
        """Take the step's result (done or timed out): end the trajectory, or append the observation."""
        fut, turn = s.future, s.turns[-1]
        if not fut.done():
            if time.monotonic() - s.submitted < self.mt.step_timeout_s:
                return
            turn.error = f"env.step timed out after {self.mt.step_timeout_s:g} s"
            turn.env_latency_s = time.monotonic() - s.submitted
            return self._end(s, "env_timeout", True, turn.error)
        try:
            value, latency = fut.result()
            obs, reward, done, info = unpack_step(value)
        except Exception as e:  # the environment's failure ends this trajectory only
            turn.error = f"{type(e).__name__}: {str(e)[:200]}"
            turn.env_latency_s = time.monotonic() - s.submitted
            return self._end(s, "env_error", True, turn.error)
        self.waiting.remove(s)
        s.future = None
        turn.reward, turn.done, turn.info, turn.env_latency_s = reward, done, info, latency
        turn.tool_calls = list(info.get("tool_calls") or [])
        turn.wait_s = time.monotonic() - s.submitted
        if self.on_turn is not None:
            self.on_turn(s.id, turn)
        if done:
            return self.engine.end(s, "done")
        if len(s.turns) >= self.mt.max_turns:
            return self.engine.end(s, "max_turns")
        self._append_observation(s, turn, obs, info)

    def _end(self, s, stop: str, failed: bool, error: str | None) -> None:
        self.waiting.remove(s)
        s.future = None
        self.engine.end(s, stop, failed, error)

    def _append_observation(self, s, turn: TurnRecord, obs: str | None, info: dict) -> None:
        given = info.pop("observation_ids", None)  # an environment that owns tokenisation (the agent gateway)
        obs_ids = [int(t) for t in given] if given is not None else _encode(self, obs)
        lo, budget = s.length, _budget(self)
        if lo + len(obs_ids) + 1 > budget:
            if lo + len(_encode(self, "")) + 1 > budget:  # the turns spent the budget: no observation could fit
                return self.engine.end(s, "max_total_tokens")
            # the observation's own length ends the trajectory: a named stop, not a silent end of the budget
            turn.observation = obs
            why = f"observation of {len(obs_ids)} tokens does not fit: {lo} tokens so far, max_total_tokens {budget}"
            return self.engine.end(s, "observation_overflow", error=why)
        turn.observation, turn.obs_start, turn.obs_end = obs, lo, lo + len(obs_ids)
        for i in range(lo, lo + len(obs_ids)):
            s.segment[i] = 2 * len(s.turns)
        start = lo + len(obs_ids)
        self.engine.extend(s, obs_ids, self.turn_end_block(start) * self.engine.K - start)


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
                 max_batch: int | None = None, engines=None) -> list[Trajectory]:
    """One batch of episodes: a fresh environment per prompt from `env_factory()`, reset with its row and seed
    (`start_episodes`), decoded (`generate_multiturn`), then closed (a failing `close` is ignored: it must
    not lose the batch). prompts: token-id lists, one per row; seeds: one per prompt (also the sampling
    seeds when config.temperature > 0)."""
    mt = mt or MultiTurnConfig()
    envs = [env_factory() for _ in prompts]
    try:
        starts = start_episodes(envs, rows, prompts, tokenizer, seeds, mt.observation_template)
        return generate_multiturn(model, starts, envs, config, mt, tokenizer=tokenizer, seeds=seeds,
                                  max_batch=max_batch, engines=engines)
    finally:
        for env in envs:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass


def _budget(driver) -> int:
    """Most tokens a trajectory of `driver` may hold: `max_total_tokens`, within the engine's canvas."""
    return min(driver.engine.T, driver.mt.max_total_tokens)


def _encode(driver, obs: str | None) -> list[int]:
    """An observation's ids: its text in the observation template, tokenised alone."""
    text = driver.mt.observation_template.format(observation=obs or "")
    return driver.tokenizer(text, add_special_tokens=False)["input_ids"]
