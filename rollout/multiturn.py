"""Multi-turn (agentic) rollouts: decode a turn, let the environment answer, decode the next turn.

`generate_multiturn(model, prompts, envs, ...)` runs one batch. Each sequence decodes its turn block by
block with the draft-and-edit step of `rollout.decoder` (the same pure steps: `block_step`, `block_done`,
`candidates`, the same prefix KV cache and `build_layout`). A turn ends when a finished block holds EOS or
a closed `</tool_call>`, or when its token budget is spent. Then:

* the turn's text goes to `env.step` in a worker thread, and the sequence *waits*; the other sequences
  keep decoding (`continue_ready=True`); when the step returns, the sequence rejoins the batch at the next
  forward. With `continue_ready=False` the whole batch pauses while any sequence waits (the pending steps
  still run concurrently): the baseline `ebpo bench agent` compares against;
* the environment's observation is wrapped in `observation_template` and tokenised alone: the turn's
  generated ids stay exactly as decoded (re-tokenising the concatenated text would not give them back),
  and the observation starts at the next block boundary after the turn (`ebpo.core.turns`: no block holds
  a model turn together with what came after it, so the likelihood sees no leaked future). The cached
  keys/values of the turn stay valid: the prefix never changes, the observation is appended;
* the sequence's next turn starts right after the observation (it may share the observation's last block,
  as a prompt's last partial block).

Limits: `max_turns`, `max_turn_tokens`, `max_total_tokens`, and `step_timeout_s` on every `env.step`
(tools have their own per-call timeout inside the environment, `rewards.envs.tools`). An environment that
raises, hangs past the timeout or returns garbage ends its trajectory as failed (recorded, counted); the
batch goes on. Multi-Block Editing and the compiled step are single-turn features: refused here.

This module knows environments only by duck typing (`reset`, `step`), so rollout keeps its import floor.
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import torch

from ebpo.core.fields import doc
from ebpo.core.turns import OBSERVATION_TEMPLATE, TOOL_CALL_CLOSE, round_up
from ebpo.model import BlockKVCache

from .config import DecodeConfig
from .decoder import _eos_ids, _make_generators
from .layout import build_layout, gather_span
from .sampling import candidates
from .steps import block_done, block_step, first_eos, penalty_targets
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


@dataclass
class _Seq:
    start: int  # first position of the current turn
    block: int
    num_blocks: int  # the turn's last block + 1
    turns: list
    status: str = "decoding"  # decoding | waiting | done
    forwards: int = 0
    turn_forwards: int = 0
    future: concurrent.futures.Future | None = None
    submitted: float = 0.0
    stop: str = ""
    failed: bool = False
    error: str | None = None
    end_time: float = 0.0
    length: int = 0  # tokens of the sequence so far (ids[:length] are final)


def _unpack_step(value):
    """(observation, reward, done, info) from a StepResult, a 4-tuple or a dict; TypeError otherwise."""
    if isinstance(value, dict):
        value = (value.get("observation"), value.get("reward", 0.0), value.get("done"), value.get("info") or {})
    obs, reward, done, info = value
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"observation must be str or None, got {type(obs).__name__}")
    if not isinstance(info, dict):
        raise TypeError(f"info must be a dict, got {type(info).__name__}")
    return obs, float(reward or 0.0), bool(done), info


def _timed_step(env, text: str):
    t0 = time.monotonic()
    out = env.step(text)
    return out, time.monotonic() - t0


@torch.no_grad()
def generate_multiturn(model, prompts: list[list[int]], envs: list, config: DecodeConfig | None = None,
                       mt: MultiTurnConfig | None = None, *, tokenizer, seeds: list[int] | None = None,
                       on_turn=None) -> list[Trajectory]:
    """Multi-turn rollouts of `prompts` (token-id lists) against `envs` (one environment per prompt, already
    `reset`); returns one `Trajectory` per prompt. `on_turn(seq, TurnRecord)` is called after every step.

    config: the decoding options (block steps only: mbe_window 0, no compiled_step); its max_new_tokens is
    unused (`mt.max_turn_tokens` bounds a turn). seeds: one per prompt (temperature > 0).
    """
    cfg = config or DecodeConfig.preset("quality")
    mt = mt or MultiTurnConfig()
    mt.validate()
    if cfg.mbe_window > 0 or cfg.compiled_step:
        raise ValueError("generate_multiturn: Multi-Block Editing and compiled_step are single-turn only; "
                         "set mbe_window=0 and compiled_step=false")
    if len(envs) != len(prompts):
        raise ValueError(f"generate_multiturn: one environment per prompt ({len(prompts)}), got {len(envs)}")
    mcfg = model.config
    K = cfg.block_size or mcfg.block_size
    mask_id, eos_ids = int(mcfg.mask_token_id), _eos_ids(mcfg)
    n = len(prompts)
    dev = next(model.parameters()).device
    gens = _make_generators(n, seeds, None, cfg.temperature, dev)
    T = round_up(max(mt.max_total_tokens, max(len(p) for p in prompts) + K), K)
    canvas = torch.full((n, T), mask_id, dtype=torch.long, device=dev)
    generated = torch.zeros((n, T), dtype=torch.bool)
    segment = torch.full((n, T), -1, dtype=torch.long)
    seqs = []
    for r, p in enumerate(prompts):
        canvas[r, :len(p)] = torch.tensor(p, dtype=torch.long, device=dev)
        segment[r, :len(p)] = 0
        s = _Seq(start=len(p), block=len(p) // K, num_blocks=0, turns=[], length=len(p))
        s.num_blocks = min(round_up(len(p) + mt.max_turn_tokens, K), round_up(min(T, mt.max_total_tokens), K), T) // K
        if len(p) >= min(T, mt.max_total_tokens):
            s.status, s.stop = "done", "max_total_tokens"
        seqs.append(s)
    post_steps = torch.zeros(n, dtype=torch.long, device=dev)
    block_iters = torch.zeros(n, dtype=torch.long, device=dev)
    cache = BlockKVCache.for_model(mcfg, n, T, dtype=next(model.parameters()).dtype, device=dev) if cfg.use_cache else None
    block_cap = K + cfg.max_post_steps + 1
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, mt.max_workers))
    batch_t0 = time.monotonic()

    def turn_text(r: int, end: int) -> tuple[str, bool]:
        toks = canvas[r, seqs[r].start:end].tolist()
        cut = first_eos(toks, eos_ids)
        if cut is not None:
            toks = toks[:cut]
        return tokenizer.decode(toks, skip_special_tokens=True), cut is not None

    def end_trajectory(r: int, stop: str, failed: bool = False, error: str | None = None) -> None:
        s = seqs[r]
        s.status, s.stop, s.failed, s.error, s.end_time = "done", stop, failed, error, time.monotonic()

    def finish_turn(r: int, finished_by: str) -> None:
        s = seqs[r]
        end = (s.block + 1) * K
        text, _ = turn_text(r, end)
        generated[r, s.start:end] = True
        segment[r, s.start:end] = 2 * len(s.turns) + 1
        s.length = end
        s.turns.append(TurnRecord(index=len(s.turns), start=s.start, end=end, text=text, finished_by=finished_by,
                                  forwards=s.turn_forwards))
        s.turn_forwards = 0
        s.submitted = time.monotonic()
        s.future = pool.submit(_timed_step, envs[r], text)
        s.status = "waiting"

    def rejoin(r: int) -> None:
        """Take the step's result (done or timed out) and either end the trajectory or append the observation."""
        s = seqs[r]
        fut, turn = s.future, s.turns[-1]
        if not fut.done():
            if time.monotonic() - s.submitted < mt.step_timeout_s:
                return
            turn.error = f"env.step timed out after {mt.step_timeout_s:g} s"
            turn.env_latency_s = time.monotonic() - s.submitted
            s.future = None
            return end_trajectory(r, "env_timeout", True, turn.error)
        s.future = None
        try:
            value, latency = fut.result()
            obs, reward, done, info = _unpack_step(value)
        except Exception as e:  # the environment's failure ends this trajectory only
            turn.error = f"{type(e).__name__}: {str(e)[:200]}"
            turn.env_latency_s = time.monotonic() - s.submitted
            return end_trajectory(r, "env_error", True, turn.error)
        turn.reward, turn.done, turn.info, turn.env_latency_s = reward, done, info, latency
        turn.tool_calls = list(info.get("tool_calls") or [])
        turn.wait_s = time.monotonic() - s.submitted
        if on_turn is not None:
            on_turn(r, turn)
        if done:
            return end_trajectory(r, "done")
        if len(s.turns) >= mt.max_turns:
            return end_trajectory(r, "max_turns")
        obs_ids = tokenizer((mt.observation_template.format(observation=obs or "")),
                            add_special_tokens=False)["input_ids"]
        lo = s.length
        budget = min(T, mt.max_total_tokens)
        if lo + len(obs_ids) + 1 > budget:
            return end_trajectory(r, "max_total_tokens")
        turn.observation, turn.obs_start, turn.obs_end = obs, lo, lo + len(obs_ids)
        canvas[r, lo:lo + len(obs_ids)] = torch.tensor(obs_ids, dtype=torch.long, device=dev)
        segment[r, lo:lo + len(obs_ids)] = 2 * len(s.turns)
        s.start = s.length = lo + len(obs_ids)
        s.block = s.start // K
        s.num_blocks = min(round_up(s.start + mt.max_turn_tokens, K), round_up(budget, K), T) // K
        post_steps[r] = 0
        block_iters[r] = 0
        s.status = "decoding"

    try:
        while True:
            for r, s in enumerate(seqs):
                if s.status == "waiting":
                    rejoin(r)
            rows = [r for r in range(n) if seqs[r].status == "decoding"]
            if not mt.continue_ready and any(s.status == "waiting" for s in seqs):
                rows = []  # baseline: the whole batch pauses while any sequence waits on its environment
            if not rows:
                waiting = [seqs[r].future for r in range(n) if seqs[r].status == "waiting"]
                if not waiting:
                    break
                concurrent.futures.wait(waiting, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
                continue
            q_start, q_end, t_start = [], [], []
            for r in rows:
                s = seqs[r]
                lo, hi = s.block * K, (s.block + 1) * K
                q_start.append(cache.lengths[r] if cache is not None else 0)
                q_end.append(hi)
                t_start.append(lo)
            S = max(cache.lengths[r] for r in rows) if cache is not None else 0
            lay = build_layout(canvas[rows], q_start, q_end, K, [None] * len(rows), S, mask_id)
            out = model(lay.input_ids, attention_mask=lay.keep, position_ids=lay.position_ids, cache=cache,
                        cache_rows=rows if cache is not None else None, return_logits=False)
            h = gather_span(out.last_hidden_state, [t_start[i] - q_start[i] for i in range(len(rows))], K)
            logits = model.lm_head(h).float()
            logits[..., mask_id] = float("-inf")  # as in rollout.decoder: a written token is never <|mask|>
            pos = torch.tensor(t_start, device=dev)[:, None] + torch.arange(K, device=dev)
            brows = torch.tensor(rows, device=dev)
            suppress = None
            if cfg.repetition_penalty:
                prev = canvas[brows[:, None], (pos - 1).clamp(min=0)].masked_fill(pos == 0, mask_id)
                suppress = penalty_targets(prev, mask_id)
            g = [gens[r] for r in rows] if gens is not None else None
            tok, prob = candidates(logits, cfg.temperature, cfg.top_k, cfg.top_p, g, suppress, cfg.repetition_penalty)
            cur = canvas[brows[:, None], pos]
            protected = pos < torch.tensor([seqs[r].start for r in rows], device=dev)[:, None]
            res = block_step(tok, prob, cur, protected, mask_id, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
            block_iters[brows] += 1
            done, post_steps[brows] = block_done(res, post_steps[brows], block_iters[brows], cfg.max_post_steps,
                                                 block_cap, cfg.editing, prob, cfg.early_commit)
            canvas[brows[:, None], pos] = res.new
            any_write, done_l = (res.m2t | res.t2t).any(-1).tolist(), done.tolist()
            commit = [t_start[i] - q_start[i] + (K if done_l[i] and not any_write[i] else 0) for i in range(len(rows))]
            if cache is not None:
                cache.commit(commit)
            for i, r in enumerate(rows):
                s = seqs[r]
                s.forwards += 1
                s.turn_forwards += 1
                if not done_l[i]:
                    continue
                end = (s.block + 1) * K
                text, has_eos = turn_text(r, end)
                if has_eos:
                    finish_turn(r, "eos")
                elif mt.stop_at_tool_call and TOOL_CALL_CLOSE in text:
                    finish_turn(r, "tool_call")
                elif s.block + 1 >= s.num_blocks:
                    finish_turn(r, "budget")
                else:
                    s.block += 1
                    post_steps[r] = 0
                    block_iters[r] = 0
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    trajs = []
    for r, s in enumerate(seqs):
        L = s.length
        trajs.append(Trajectory(prompt_ids=list(prompts[r]), ids=canvas[r, :L].tolist(),
                                generated=generated[r, :L].tolist(), segment=segment[r, :L].tolist(), turns=s.turns,
                                stop=s.stop or "done", failed=s.failed, error=s.error,
                                env_reward=sum(t.reward for t in s.turns), num_forwards=s.forwards,
                                wall_s=(s.end_time or time.monotonic()) - batch_t0))
    return trajs


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
                 mt: MultiTurnConfig | None = None, *, tokenizer, seeds: list[int] | None = None) -> list[Trajectory]:
    """One batch of episodes: a fresh environment per prompt from `env_factory()`, reset with its row and seed
    (`start_episodes`), decoded (`generate_multiturn`), then closed (a failing `close` is ignored: it must
    not lose the batch). prompts: token-id lists, one per row; seeds: one per prompt (also the sampling
    seeds when config.temperature > 0)."""
    mt = mt or MultiTurnConfig()
    envs = [env_factory() for _ in prompts]
    try:
        starts = start_episodes(envs, rows, prompts, tokenizer, seeds, mt.observation_template)
        return generate_multiturn(model, starts, envs, config, mt, tokenizer=tokenizer, seeds=seeds)
    finally:
        for env in envs:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass
