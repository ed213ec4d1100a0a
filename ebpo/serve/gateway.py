"""The agent gateway: agent functions talk to the policy through the real `openai` client; every token the
learner sees is a token the engine sampled.

An *agent function* is any async function `agent(client, row) -> reward | record`: `client` is an
`openai.AsyncOpenAI` pointed at this gateway (one client per episode, its base URL naming the episode), `row`
the dataset row. It runs any harness, calls `client.chat.completions.create(...)` as often as it likes, and
returns a float (the episode's reward) or a dict (a record for the reward functions: its "reward" key, if any,
is the episode's reward; the whole dict reaches rewards as `trajectory["agent"]`)::

    async def calculator_agent(client, row):                       # examples/agents/calculator_agent.py
        messages = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        ...
        return 1.0 if solved else 0.0

`AgentGateway.run(agent, rows, seeds)` runs one episode per row, all concurrently, and returns one rollout
sample per row (the dict shape of `rollout.worker.RolloutWorker.generate` for multi-turn rows).

Token-exact episodes. The gateway, not the harness, owns tokenisation. The first request of an episode is
rendered (chat template, tools, `ebpo.serve.render`) into the prompt of one engine sequence that carries the
episode as its environment. The engine decodes a turn (ending at EOS, a closed `</tool_call>` or the turn
budget, on a block boundary) and the request is answered with it. A later request whose messages *extend* the
episode (the earlier messages, then the assistant message the gateway returned, then new tool / user messages)
is appended: only the new messages are rendered (`render.extension_ids`) and placed after the turn's last
block, and the sequence decodes its next turn with its KV cache and its generator. Nothing already in the
sequence is re-tokenised, so the learner trains on exactly the ids that were sampled, under the turn-aligned
mask (`ebpo.core.turns`). A request that *rewrites* history (anything else) ends the current segment and
starts a new sequence from the rendered messages: the episode's earlier segments are kept, recorded as
rewritten, in `trajectory["segments"]`.

Decoding follows the trainer's rollout settings: a request's sampling fields (temperature, max_tokens, seed,
mode, ...) are ignored, the `model` name is not checked, and `n` must be 1. A request past the episode's limits
(`MultiTurnConfig`: turns, tokens, the wait for the next request) gets a 400 with code `episode_over`.

Bounded in time (T = `MultiTurnConfig.step_timeout_s`). The agent must send its first request within T of the
episode's start, and each next one within T of the previous answer (the clock stops while a request decodes).
Past that the episode is over: its sequence ends with stop `env_timeout` (the limit's; the agent is not counted
as failed), its slot is free, and a later request gets `episode_over`. An agent that still has not returned T
after that is cancelled: stop `agent_timeout`, failed, reward 0 (`agent/stop/agent_timeout`,
`agent/failed_count`). A hung agent so costs at most 2 T of wall time and T of an engine row; `run` returns.

Tool calls. Every `<tool_call>` the model writes in a turn is recorded in the turn's `tool_calls` (what
`agent/tool_calls`, `agent/tool_errors` and the trajectories table count), checked against the request's
`tools` (`render.tool_call_records`); what a tool returns when the harness runs it is not seen here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
import time

from rollout.multiturn import MultiTurnConfig, trajectory_of
from rollout.trajectory import Trajectory

from .app import create_app
from .driver import EngineDriver
from .render import assistant_message, extension_ids, prompt_ids, same_assistant, tool_call_records
from .schema import ChatRequest, RequestError

END, REWRITE, TIMEOUT = "end", "rewrite", "timeout"  # why a segment's sequence is ended by the gateway


class EpisodeOver(Exception):
    """The episode's sequence ended (a limit of `MultiTurnConfig`) before it could answer a request."""


class Episode:
    """One agent episode. To the engine it is the environment of its current segment's sequence: `step(turn)`
    answers the request that waits for the turn, then waits until the agent's next request is handed over
    (`offer`: an extension, whose rendered ids become the observation) or the segment is ended (`end`: the
    agent returned, rewrote its history, or let the time pass). A request can only be handed to a waiting
    step, under the same lock the step stops waiting under: one that comes too late is refused, never queued
    where nobody reads it.

    The agent's clock (event loop): `in_flight` requests being answered, `idle_since` the end of the last
    one (or the start), `expired` once T passed without a request (module docstring)."""

    def __init__(self, eid: str, row: dict, generator, wait_s: float):
        self.id, self.row, self.generator, self.wait_s = eid, row, generator, wait_s
        self.history: list[dict] | None = None  # the messages so far, the last assistant reply included
        self.reply: concurrent.futures.Future | None = None
        self.seq = None
        self.driver = None
        self.segment: concurrent.futures.Future | None = None  # the current sequence's driver future
        self.finished: list = []  # (Sequence, why it ended) of the segments so far
        self.lock = asyncio.Lock()
        self.turns_answered = 0
        self.in_flight, self.idle_since = 0, time.monotonic()
        self.expired, self.expired_at = False, 0.0
        # guarded by `cv`, shared with the engine's driver thread: the current segment's state
        self.cv = threading.Lock()
        self.waiting = False  # a step waits for the agent's next request
        self.pending: concurrent.futures.Future | None = None  # that step's outcome, completed by offer / end
        self.info: dict = {}  # the waiting turn's record (its tool calls)
        self.ending = None  # END / REWRITE / TIMEOUT: the segment ends at its next (or its waiting) step
        self.ended_by = None  # what the segment's last step returned on
        self.tools = None  # the tools of the request the current turn answers

    def bind(self, seq, driver) -> None:  # driver thread: the engine holds the sequence
        self.seq, self.driver = seq, driver

    def start_segment(self, reply, tools) -> None:
        with self.cv:
            self.reply, self.seq, self.tools = reply, None, tools
            self.waiting, self.pending, self.ending, self.ended_by = False, None, None, None

    def step_async(self, text: str) -> concurrent.futures.Future:
        """The environment's step, without a thread (`rollout.multiturn.TurnDriver` takes the future as it is):
        answer the request that waits for the turn, and return a future of the step's outcome that the agent's
        next request (`offer`: an extension, whose rendered ids become the observation) or the segment's end
        (`end`) completes. The engine's step timeout (3 T + 10 s) is only a backstop: the agent's clock ends a
        wait at T (`expire`)."""
        turn = self.seq.turns[-1]
        ids = self.driver.engine.runner.read(self.seq, turn.start, turn.end)  # the slot is frozen: WAITING
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        with self.cv:
            self.info = {"tool_calls": tool_call_records(text, self.tools)}
            try:
                self.reply.set_result((text, ids, turn.finished_by))
            except concurrent.futures.InvalidStateError:  # the agent stopped waiting: its wait cancelled the reply
                pass  # (in the event loop, at any moment): the turn stays, the segment ends (`end`, in _answer)
            self.pending = fut
            if self.ending is not None:
                self._close_step()
            else:
                self.waiting = True
        return fut

    def _close_step(self) -> None:
        """The pending step ends the segment (under `cv`)."""
        self.waiting, self.ended_by = False, self.ending
        fut, self.pending = self.pending, None
        fut.set_result(((None, 0.0, True, {**self.info, "ended_by": self.ending}), 0.0))

    def offer(self, obs_ids: list[int], reply, tools) -> bool:
        """Hand the waiting step the agent's next request; False when no step waits (the segment ended or is
        ending: the request comes too late)."""
        with self.cv:
            if not self.waiting or self.ending is not None:
                return False
            self.waiting, self.reply, self.tools = False, reply, tools
            fut, self.pending = self.pending, None
            obs = self.driver.tokenizer.decode(obs_ids)
            fut.set_result(((obs, 0.0, False, {**self.info, "observation_ids": obs_ids}), 0.0))
            return True

    def end(self, why: str) -> None:
        """End the current segment: at once if its step waits, else at its next step."""
        with self.cv:
            if self.ending is None:
                self.ending = why
            if self.waiting:
                self._close_step()

    def expire(self) -> None:
        """The agent let T pass without a request (event loop): the episode is over."""
        self.expired, self.expired_at = True, time.monotonic()
        self.end(TIMEOUT)

    def over_because(self) -> str:
        if self.expired:
            return f"no request came within step_timeout_s ({self.wait_s:g} s)"
        if self.segment is not None and self.segment.done() and self.segment.exception() is None:
            return self.segment.result().stop or "done"
        return "its sequence is ending"


def asgi_http_client(app):
    """An async HTTP client of the `openai` package's own HTTP library (httpx or httpx2, by its version) that
    sends every request straight into the ASGI `app`, in-process, no socket."""
    import importlib

    import openai

    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    lib = importlib.import_module(base.__module__.split(".")[0])
    return openai.DefaultAsyncHttpxClient(transport=lib.ASGITransport(app=app), timeout=None)


class AgentGateway:
    """The in-process OpenAI-compatible gateway of agent RL (module docstring).

    model, tokenizer: the policy; config: the rollout `DecodeConfig` (every request decodes with it);
    mt: the episode limits (`MultiTurnConfig`: max_turns, max_turn_tokens, max_total_tokens, and
    step_timeout_s, here the longest wait for an agent's next request); max_batch: most episodes decoding at
    once (0 = 64). `run(agent, rows, seeds)` runs the episodes; `close()` stops the engine thread.
    """

    def __init__(self, model, tokenizer, config, mt: MultiTurnConfig | None = None, *, max_batch: int = 0,
                 name: str = "policy"):
        from dataclasses import replace
        from types import SimpleNamespace

        from ebpo.core.turns import round_up

        mt = mt or MultiTurnConfig()
        mt.validate()
        # an episode's step is a future its agent's next request completes (`Episode.step_async`): no thread
        self.mt = mt
        # the agent's clock ends a wait at step_timeout_s (`Episode.expire`); the engine's own step timeout,
        # which would fail the trajectory, is only a backstop behind it
        engine_mt = replace(self.mt, step_timeout_s=3 * mt.step_timeout_s + 10.0)
        self.model, self.tokenizer, self.config, self.name = model, tokenizer, config, name
        # requests are rendered (in `render_pool`'s one thread, off the event loop) while the engine's thread
        # decodes with `tokenizer`: a fast tokenizer's encode takes its Rust object mutably ("Already
        # borrowed" under concurrent use), so rendering has its own copy
        self.render_tokenizer = copy.deepcopy(tokenizer)
        self.render_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ebpo-gateway-render")
        self.block_size = config.block_size or model.config.block_size
        self.eos_id = int(tokenizer.eos_token_id)
        max_len = round_up(self.mt.max_total_tokens + self.block_size, self.block_size)
        self.driver = EngineDriver(model, tokenizer, max_batch=max_batch or 64, max_len=max_len, mt=engine_mt,
                                   engine_config=config).start()
        self.app = create_app(SimpleNamespace(name=name, default=config, max_tokens_limit=1 << 30),
                              complete=self._complete)
        self.episodes: dict[str, Episode] = {}
        self._runs = 0

    def close(self) -> None:
        self.driver.close()
        self.render_pool.shutdown(wait=False)

    # ---- running episodes
    def run(self, agent, rows: list[dict], seeds: list[int] | None = None) -> list[dict]:
        """One episode of `agent` per row, all at once (seed i seeds episode i's sampling when the rollout
        temperature is > 0); returns one rollout sample dict per row, in order (module docstring)."""
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"AgentGateway.run: one seed per row ({len(rows)}), got {len(seeds)}")
        self._runs += 1
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(self._run_all(agent, rows, seeds))
        finally:
            _close_loop(loop)

    async def _run_all(self, agent, rows, seeds) -> list[dict]:
        async with asgi_http_client(self.app) as http:
            return list(await asyncio.gather(*(self._episode(agent, http, row, None if seeds is None else seeds[i],
                                                             f"{self._runs}-{i}") for i, row in enumerate(rows))))

    async def _episode(self, agent, http, row: dict, seed: int | None, eid: str) -> dict:
        import openai

        from .service import make_generators

        gen = make_generators(1, seed, self.config.temperature, next(self.model.parameters()).device)[0]
        ep = Episode(eid, row, gen, self.mt.step_timeout_s)
        self.episodes[eid] = ep
        client = openai.AsyncOpenAI(base_url=f"http://gateway/episodes/{eid}/v1", api_key="gateway",
                                    http_client=http, max_retries=0)
        t0 = time.monotonic()
        task = asyncio.ensure_future(agent(client, dict(row)))
        hung = await self._watch(ep, task)
        result, error = None, None
        if not hung:
            try:
                result = task.result()
            except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - the agent's failure is its episode's
                error = e
        await self._end_segment(ep, END)
        del self.episodes[eid]
        return episode_sample(ep, result, error, t0, self.block_size, hung=hung)

    async def _watch(self, ep: Episode, task: asyncio.Future) -> bool:
        """Wait for the agent function; expire its episode when it lets T pass without a request, cancel it
        when T more pass (module docstring). True when it was cancelled (an agent that ignores the
        cancellation is abandoned after a second)."""
        T = self.mt.step_timeout_s
        while not task.done():
            now = time.monotonic()
            due = None if ep.in_flight else (ep.expired_at if ep.expired else ep.idle_since) + T
            if due is not None and now >= due:
                if not ep.expired:
                    ep.expire()
                    continue
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
                return True
            await asyncio.wait({task}, timeout=min(T, 1.0) if due is None else due - now)
        return False

    async def _end_segment(self, ep: Episode, why: str) -> None:
        """End the running segment (its step returns done) and wait until its sequence is finished; record it
        with why it ended (`rewritten`, `env_timeout` when the agent let T pass, or the engine's stop)."""
        if ep.segment is None:
            return
        ep.end(why)
        try:
            seq = await asyncio.wrap_future(ep.segment)
        except ValueError:  # the engine refused the segment (a prompt longer than the canvas): it never ran and
            ep.segment = None  # its request got episode_over; the episode and the batch go on without it
            return
        stop = seq.stop or "done"
        if why == REWRITE:
            stop = "rewritten"
        elif stop == "done" and ep.ended_by == TIMEOUT:
            stop = "env_timeout"
        ep.finished.append((seq, stop))
        ep.segment = None

    # ---- one request
    async def _complete(self, request, req: ChatRequest) -> dict:
        ep = self.episodes.get(request.path_params.get("episode", ""))
        if ep is None:
            raise RequestError("the gateway serves episodes: /episodes/{episode}/v1 of a running episode", None,
                               "unknown_episode", status=404)
        if req.n != 1:
            raise RequestError("an agent episode samples one completion per request (n = 1)", "n")
        ep.in_flight += 1  # the agent's clock stops while its request is answered
        try:
            return await self._answer(ep, req)
        finally:
            ep.in_flight -= 1
            ep.idle_since = time.monotonic()

    async def _answer(self, ep: Episode, req: ChatRequest) -> dict:
        over = "the episode is over ({}); no more turns"
        async with ep.lock:
            if ep.expired:
                raise RequestError(over.format(ep.over_because()), "messages", "episode_over")
            reply: concurrent.futures.Future = concurrent.futures.Future()
            tools = req.tools if req.tool_choice != "none" else None
            if ep.history is not None and ep.segment is not None and _extends(ep.history, req.messages):
                ids = await self._render(extension_ids, self.render_tokenizer, req.messages[len(ep.history):],
                                         self.mt.observation_template)
                if not ep.offer(ids, reply, tools):
                    raise RequestError(over.format(ep.over_because()), "messages", "episode_over")
            else:
                await self._end_segment(ep, REWRITE)
                ids = await self._render(prompt_ids, self.render_tokenizer, req.messages, tools, self.block_size,
                                         self.eos_id, self.mt.observation_template)
                self._start_segment(ep, ids, reply, tools)
            try:
                text, ids, finished_by = await asyncio.wrap_future(reply)
            except EpisodeOver as e:
                raise RequestError(over.format(e), "messages", "episode_over") from None
            except asyncio.CancelledError:  # the agent gave up waiting: the turn it asked for ends the segment
                ep.end(END)
                raise
            message, has_calls = assistant_message(text, [f"call_{ep.id}_{ep.turns_answered}_{k}"
                                                          for k in range(text.count("<tool_call>"))])
            ep.turns_answered += 1
            ep.history = list(req.messages) + [message]
        finish = "tool_calls" if has_calls else ("length" if finished_by == "budget" else "stop")
        start = ep.seq.start if ep.seq is not None else 0
        return {"id": f"chatcmpl-{ep.id}-{ep.turns_answered}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                 "logprobs": None, "token_ids": ids}],
                "usage": {"prompt_tokens": start, "completion_tokens": len(ids), "total_tokens": start + len(ids),
                          "forwards": ep.seq.turns[-1].forwards if ep.seq is not None and ep.seq.turns else 0}}

    async def _render(self, fn, *args) -> list[int]:
        """`fn(*args)` (a render function) in the gateway's one tokenising thread; RequestError on ValueError."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.render_pool, fn, *args)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None

    def _start_segment(self, ep: Episode, ids: list[int], reply, tools) -> None:
        ep.start_segment(reply, tools)
        ep.segment = self.driver.submit(ids, self.config, ep.generator, env=ep, on_start=ep.bind)

        def over(fut):  # the sequence ended (a limit, or a failed step) while a request waited for a turn
            stop = fut.result().stop if fut.exception() is None else f"failed: {fut.exception()!r}"
            for waiting in {reply, ep.reply}:
                if waiting is not None and not waiting.done():
                    waiting.set_exception(EpisodeOver(stop))

        ep.segment.add_done_callback(over)


def _extends(history: list[dict], messages: list[dict]) -> bool:
    """Whether `messages` are `history` (its last message the assistant reply the gateway returned) followed
    by at least one new message."""
    n = len(history)
    if len(messages) <= n:
        return False
    for a, b in zip(history[:-1], messages[: n - 1]):
        if (a["role"], a["content"]) != (b["role"], b["content"]) or (
                a["role"] == "assistant" and not same_assistant(b, a)):
            return False
    return messages[n - 1]["role"] == "assistant" and same_assistant(messages[n - 1], history[-1])


def episode_sample(ep: Episode, result, error: BaseException | None, t0: float, block_size: int,
                   hung: bool = False) -> dict:
    """The rollout sample of a finished episode: its last segment as the trained trajectory, the agent's reward
    as `env_reward`, its record as `trajectory["agent"]`, the earlier (rewritten) segments in
    `trajectory["segments"]`. hung: the agent function was cancelled at its deadline (stop `agent_timeout`,
    failed); an error after a limit ended the episode (`episode_over` let raise) is no failure."""
    timeout = f"the agent function did not return within 2 x step_timeout_s ({2 * ep.wait_s:g} s) of its last answer"
    if not ep.finished:
        why = timeout if hung else (f"{type(error).__name__}: {str(error)[:200]}" if error is not None
                                    else "the agent made no request")
        traj = Trajectory(prompt_ids=[], ids=[], generated=[], segment=[], turns=[], failed=True, error=why,
                          stop="agent_timeout" if hung or ep.expired else "agent_error")
        return _sample(traj, [], {"error": why}, 0)
    seq, why = ep.finished[-1]
    traj = trajectory_of(seq, t0, block_size)
    traj.stop = why
    record = dict(result) if isinstance(result, dict) else {"reward": result}
    limit = traj.stop not in ("done", "rewritten")  # the engine or the clock ended it: a refusal is no failure
    if hung or (error is not None and not limit):
        traj.failed, traj.stop = True, "agent_timeout" if hung else "agent_error"
        traj.error = timeout if hung else f"{type(error).__name__}: {str(error)[:200]}"
        record = {"error": traj.error}
    reward = record.get("reward")
    traj.env_reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else 0.0
    earlier = []
    for s, w in ep.finished[:-1]:
        d = trajectory_of(s, t0, block_size).to_dict()
        d["stop"] = w
        earlier.append(d)
    return _sample(traj, earlier, record, 0)


def _sample(traj: Trajectory, earlier: list[dict], record: dict, version: int) -> dict:
    response = traj.ids[len(traj.prompt_ids):]
    last = traj.turns[-1] if traj.turns else None
    traj.agent, traj.segments = record, earlier
    d = traj.to_dict()
    return {"token_ids": response, "text": last.text if last else "", "num_forwards": traj.num_forwards,
            "tpf": traj.num_generated / max(traj.num_forwards, 1), "num_edits": traj.num_edits,
            "finished_by_eos": bool(last and last.finished_by == "eos"), "weights_version": version,
            "trajectory": d, "lev_drafts": [[off, list(dr)] for off, dr in traj.lev_drafts]}


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close a batch's event loop without waiting on an abandoned agent (one that ignored its cancellation):
    what is left gets one more cancellation and a second to finish (`asyncio.run` would wait forever)."""
    left = asyncio.all_tasks(loop)
    for t in left:
        t.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left, timeout=1.0))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
