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
mode, ...) are ignored, and `n` must be 1. A request past the episode's limits (`MultiTurnConfig`: turns,
tokens, the wait for the next request) gets a 400 with code `episode_over`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import queue
import time

from rollout.multiturn import MultiTurnConfig, trajectory_of
from rollout.trajectory import Trajectory

from .app import create_app
from .driver import EngineDriver
from .render import assistant_message, extension_ids, prompt_ids, same_assistant
from .schema import ChatRequest, RequestError

END, REWRITE = "end", "rewrite"


class EpisodeOver(Exception):
    """The episode's sequence ended (a limit of `MultiTurnConfig`) before it could answer a request."""


class Episode:
    """One agent episode. To the engine it is the environment of its current segment's sequence: `step(turn)`
    answers the request that waits for the turn, then blocks until the agent's next request (an extension:
    its rendered ids become the observation), the end of the agent function, or a rewrite (both end the
    sequence)."""

    def __init__(self, eid: str, row: dict, generator, wait_s: float):
        self.id, self.row, self.generator, self.wait_s = eid, row, generator, wait_s
        self.history: list[dict] | None = None  # the messages so far, the last assistant reply included
        self.inbox: queue.Queue = queue.Queue()
        self.reply: concurrent.futures.Future | None = None
        self.seq = None
        self.engine = None
        self.segment: concurrent.futures.Future | None = None  # the current sequence's driver future
        self.finished: list = []  # (Sequence, why it ended) of the segments so far
        self.lock = asyncio.Lock()
        self.turns_answered = 0

    def bind(self, seq, engine) -> None:  # driver thread: the engine holds the sequence
        self.seq, self.engine = seq, engine

    def step(self, text: str):
        """The engine's env.step (a step thread): answer the waiting request, wait for what comes next."""
        turn = self.seq.turns[-1]
        ids = self.engine.slots.canvas[self.seq.slot, turn.start:turn.end].tolist()  # the slot is frozen: WAITING
        self.reply.set_result((text, ids, turn.finished_by))
        try:
            kind, obs_ids, reply = self.inbox.get(timeout=self.wait_s)
        except queue.Empty:
            kind, obs_ids, reply = END, None, None
        if kind != "extend":
            return None, 0.0, True, {"ended_by": kind}
        self.reply = reply
        return self.engine.tokenizer.decode(obs_ids), 0.0, False, {"observation_ids": obs_ids}


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
        # every episode waiting on its agent holds a step thread: no cap below the number of episodes
        self.mt = replace(mt, max_workers=max(mt.max_workers, 4096))
        self.model, self.tokenizer, self.config, self.name = model, tokenizer, config, name
        # requests are rendered on the event loop while the engine and step threads decode with `tokenizer`: a
        # fast tokenizer's encode takes its Rust object mutably ("Already borrowed" under concurrent use)
        self.render_tokenizer = copy.deepcopy(tokenizer)
        self.block_size = config.block_size or model.config.block_size
        self.eos_id = int(tokenizer.eos_token_id)
        max_len = round_up(self.mt.max_total_tokens + self.block_size, self.block_size)
        self.driver = EngineDriver(model, tokenizer, max_batch=max_batch or 64, max_len=max_len, mt=self.mt,
                                   engine_config=config).start()
        self.app = create_app(SimpleNamespace(name=name, default=config, max_tokens_limit=1 << 30),
                              complete=self._complete)
        self.episodes: dict[str, Episode] = {}
        self._runs = 0

    def close(self) -> None:
        self.driver.close()

    # ---- running episodes
    def run(self, agent, rows: list[dict], seeds: list[int] | None = None) -> list[dict]:
        """One episode of `agent` per row, all at once (seed i seeds episode i's sampling when the rollout
        temperature is > 0); returns one rollout sample dict per row, in order (module docstring)."""
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"AgentGateway.run: one seed per row ({len(rows)}), got {len(seeds)}")
        self._runs += 1
        return asyncio.run(self._run_all(agent, rows, seeds))

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
        result, error = None, None
        try:
            result = await agent(client, dict(row))
        except Exception as e:  # noqa: BLE001 - the agent's failure belongs to its episode
            error = e
        await self._end_segment(ep, END)
        del self.episodes[eid]
        return episode_sample(ep, result, error, t0, self.block_size)

    async def _end_segment(self, ep: Episode, why: str) -> None:
        """End the running segment (the step thread returns done) and wait until its sequence is finished."""
        if ep.segment is None:
            return
        ep.inbox.put((why, None, None))
        seq = await asyncio.wrap_future(ep.segment)
        ep.finished.append((seq, "rewritten" if why == REWRITE else seq.stop or "done"))
        ep.segment = None

    # ---- one request
    async def _complete(self, request, req: ChatRequest) -> dict:
        ep = self.episodes.get(request.path_params.get("episode", ""))
        if ep is None:
            raise RequestError("the gateway serves episodes: /episodes/{episode}/v1 of a running episode", None,
                               "unknown_episode", status=404)
        if req.n != 1:
            raise RequestError("an agent episode samples one completion per request (n = 1)", "n")
        async with ep.lock:
            reply: concurrent.futures.Future = concurrent.futures.Future()
            if ep.history is not None and ep.segment is not None and _extends(ep.history, req.messages):
                if ep.segment.done():
                    raise RequestError(f"the episode is over ({ep.segment.result().stop}); no more turns", "messages",
                                       "episode_over")
                try:
                    ids = extension_ids(self.render_tokenizer, req.messages[len(ep.history):], self.mt.observation_template)
                except ValueError as e:
                    raise RequestError(str(e), "messages") from None
                ep.inbox.put(("extend", ids, reply))
            else:
                await self._end_segment(ep, REWRITE)
                self._start_segment(ep, req, reply)
            try:
                text, ids, finished_by = await asyncio.wrap_future(reply)
            except EpisodeOver as e:
                raise RequestError(f"the episode is over ({e}); no more turns", "messages", "episode_over") from None
            message, has_calls = assistant_message(text, [f"call_{ep.id}_{ep.turns_answered}_{k}"
                                                          for k in range(text.count("<tool_call>"))])
            ep.turns_answered += 1
            ep.history = list(req.messages) + [message]
        finish = "tool_calls" if has_calls else ("length" if finished_by == "budget" else "stop")
        return {"id": f"chatcmpl-{ep.id}-{ep.turns_answered}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                 "logprobs": None, "token_ids": ids}],
                "usage": {"prompt_tokens": ep.seq.start if ep.seq is not None else 0, "completion_tokens": len(ids),
                          "total_tokens": (ep.seq.start if ep.seq is not None else 0) + len(ids),
                          "forwards": ep.seq.turns[-1].forwards if ep.seq is not None and ep.seq.turns else 0}}

    def _start_segment(self, ep: Episode, req: ChatRequest, reply) -> None:
        try:
            ids = prompt_ids(self.render_tokenizer, req.messages, req.tools if req.tool_choice != "none" else None,
                             self.block_size, self.eos_id, self.mt.observation_template)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        ep.reply, ep.seq, ep.inbox = reply, None, queue.Queue()  # a fresh inbox: nothing stale of an ended segment
        ep.segment = self.driver.submit(ids, self.config, ep.generator, env=ep, on_start=ep.bind)

        def over(fut):  # the sequence ended (a limit, or a failed step) while a request waited for a turn
            if not reply.done():
                stop = fut.result().stop if fut.exception() is None else repr(fut.exception())
                reply.set_exception(EpisodeOver(stop))
            if ep.reply is not None and ep.reply is not reply and not ep.reply.done():
                ep.reply.set_exception(EpisodeOver(fut.result().stop if fut.exception() is None else "failed"))

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


def episode_sample(ep: Episode, result, error: BaseException | None, t0: float, block_size: int) -> dict:
    """The rollout sample of a finished episode: its last segment as the trained trajectory, the agent's reward
    as `env_reward`, its record as `trajectory["agent"]`, the earlier (rewritten) segments in
    `trajectory["segments"]`."""
    if not ep.finished:
        why = f"{type(error).__name__}: {str(error)[:200]}" if error is not None else "the agent made no request"
        traj = Trajectory(prompt_ids=[], ids=[], generated=[], segment=[], turns=[], stop="agent_error", failed=True,
                          error=why)
        return _sample(traj, [], {"error": why}, 0)
    seq, why = ep.finished[-1]
    traj = trajectory_of(seq, t0, block_size)
    record = dict(result) if isinstance(result, dict) else {"reward": result}
    limit = traj.stop not in ("done", "rewritten")  # the engine ended it: the agent's refusal is no failure
    if error is not None and not limit:
        traj.failed, traj.stop = True, "agent_error"
        traj.error = f"{type(error).__name__}: {str(error)[:200]}"
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
