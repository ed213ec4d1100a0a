"""`ChatService`: a validated chat request -> sequences on the engine driver -> an OpenAI chat completion.

One request with `n` choices is `n` sequences of the same prompt; choice i samples with its own generator
seeded `seed + i`, exactly as `ebpo generate --seed SEED` seeds its i-th sequence, so a request with a seed
gives the tokens `ebpo generate` gives for that prompt, seed and settings. Without a seed (and temperature
> 0) each choice draws a fresh seed. All sequences of all concurrent requests go through one
`EngineDriver`: requests with the same decode settings share forwards.

Tokenising (the prompt, the choices' text) runs in one worker thread of the service, on its own copy of the
tokenizer (a fast tokenizer is not safe to share between threads), never on the event loop. Before the prompt
is tokenised, its length is bounded from its characters: no token of the vocabulary spells more than
`max_token_chars` characters, so messages of more than (context - max_tokens) x max_token_chars characters
cannot fit and are refused (`context_length_exceeded`) without tokenising them. A request cancelled while its
sequences decode (its client went away, the server's shutdown grace ended) aborts them
(`EngineDriver.abort`): they leave the batch at the next forward.

At most `max_sequences` sequences (n per request, summed over the requests being answered) are held at once;
a request that would pass the bound is refused with a 429 (`rate_limit_exceeded`, `Retry-After`) before any
work. `stream(req)` answers with server-sent events (`ChatStream`): each block a sequence commits is a chunk.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import threading
import time
import uuid

import torch

from rollout.config import DecodeConfig
from rollout.steps import first_eos

from .render import assistant_message, prompt_ids
from .schema import ChatRequest, RequestError

log = logging.getLogger("ebpo.serve")
RETRY_AFTER_S = 1


def make_generators(n: int, seed: int | None, temperature: float, device: torch.device) -> list:
    """One generator per choice (None when greedy): seeds seed, seed+1, ... as `ebpo generate` seeds its
    sequences; fresh ones when seed is None."""
    if temperature == 0:
        return [None] * n
    seeds = [seed + i for i in range(n)] if seed is not None else [torch.Generator().seed() for _ in range(n)]
    gdev = device if device.type == "cuda" else "cpu"
    return [torch.Generator(device=gdev).manual_seed(int(s)) for s in seeds]


def sequence_output(seq, eos_ids: set[int], tokenizer) -> tuple[list[int], str, bool]:
    """(generated ids cut after the first EOS (EOS kept), their text, ended by EOS) of a finished single-turn
    `Sequence` (what `rollout.decoder.generate` reports for it)."""
    P = seq.prompt_len
    toks = seq.canvas[P:P + seq.max_new]
    cut = first_eos(toks, eos_ids)
    if cut is not None:
        toks = toks[: cut + 1]
    return toks, tokenizer.decode(toks, skip_special_tokens=True), cut is not None


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for: the longest vocabulary entry (added and
    special tokens included). A byte-level entry spells one character per byte, so it bounds the text's
    characters too; a byte-fallback entry such as `<0x0A>` only overestimates."""
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def apply_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` cut before the earliest occurrence of any stop string; whether one occurred."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class ChatService:
    """Chat completions of `model` on `driver`. default: the server's `DecodeConfig` (a request overrides its
    fields); max_len: prompt + max_tokens must fit it (the driver's canvas)."""

    def __init__(self, model, tokenizer, driver, name: str, default: DecodeConfig, max_sequences: int | None = None):
        self.model, self.tokenizer, self.driver, self.name, self.default = model, tokenizer, driver, name, default
        self.max_sequences = int(max_sequences) if max_sequences is not None else 4 * driver.max_batch
        self.held = 0  # sequences of the requests being answered (reserve / release)
        self._held_lock = threading.Lock()
        mcfg = model.config
        self.block_size = default.block_size or mcfg.block_size
        self.eos_ids = {int(e) for e in (mcfg.eos_token_id if isinstance(mcfg.eos_token_id, (list, tuple))
                                         else [mcfg.eos_token_id])}
        self.eos_id = int(tokenizer.eos_token_id)
        self.device = next(model.parameters()).device
        self.max_token_chars = max_token_chars(tokenizer)
        self.cpu_tokenizer = copy.deepcopy(tokenizer)  # used only in the one `cpu` thread
        self.cpu = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ebpo-serve-tokenize")

    @property
    def max_tokens_limit(self) -> int:
        return self.driver.max_len

    def render(self, req: ChatRequest) -> list[int]:
        """The prompt's token ids (in the `cpu` thread); RequestError when it cannot fit the context, decided
        from its characters before tokenising when they alone rule it out (module docstring)."""
        room = self.driver.max_len - req.config.max_new_tokens
        chars = sum(len(m["content"]) for m in req.messages)
        if chars > room * self.max_token_chars:
            raise RequestError(f"the messages hold {chars} characters: at least {-(-chars // self.max_token_chars)} "
                               f"tokens, more than the {room} this server's context of {self.driver.max_len} leaves "
                               f"beside max_tokens ({req.config.max_new_tokens})", "messages",
                               "context_length_exceeded")
        try:
            ids = prompt_ids(self.cpu_tokenizer, req.messages, req.tools if req.tool_choice != "none" else None,
                             self.block_size, self.eos_id)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        need = len(ids) + req.config.max_new_tokens
        if need > self.driver.max_len:
            raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({req.config.max_new_tokens}) is "
                               f"{need} tokens, more than this server's context of {self.driver.max_len}",
                               "messages", "context_length_exceeded")
        return ids

    def reserve(self, n: int) -> None:
        """Count `n` more sequences held, or RequestError 429 when that would pass `max_sequences`."""
        with self._held_lock:
            if self.held + n > self.max_sequences:
                raise RequestError(f"this server holds {self.held} of at most {self.max_sequences} sequences; a "
                                   f"request of {n} must wait: retry in a moment", None, "rate_limit_exceeded",
                                   status=429, type="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
            self.held += n

    def release(self, n: int) -> None:
        with self._held_lock:
            self.held -= n

    def check_model(self, req: ChatRequest) -> None:
        if req.model != self.name:
            raise RequestError(f"the model {req.model!r} does not exist; this server serves {self.name!r}", "model",
                               "model_not_found", status=404)

    async def complete(self, req: ChatRequest) -> dict:
        """The chat completion (OpenAI shape) of a validated request."""
        self.check_model(req)
        self.reserve(req.n)
        try:
            return await self._complete(req)
        finally:
            self.release(req.n)

    async def _complete(self, req: ChatRequest) -> dict:
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self.cpu, self.render, req)
        gens = make_generators(req.n, req.seed, req.config.temperature, self.device)
        futures = [self.driver.submit(ids, req.config, g, req.config.max_new_tokens) for g in gens]
        try:
            seqs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # the client went away, or the shutdown grace ended: stop decoding
            for f in futures:
                if not f.done():
                    self.driver.abort(f)
            raise
        except ValueError as e:  # the engine refused the sequence: it does not fit, or the model cannot decode so
            fits = "does not fit" in str(e)
            param = "messages" if fits else next((k for k in ("tau_delete", "tau_insert") if k in str(e)), None)
            raise RequestError(str(e), param, "context_length_exceeded" if fits else "unsupported_value") from None
        outputs = await loop.run_in_executor(
            self.cpu, lambda: [sequence_output(s, self.eos_ids, self.cpu_tokenizer) for s in seqs])
        choices, completion_tokens, forwards = [], 0, 0
        for i, (seq, (toks, text, eos)) in enumerate(zip(seqs, outputs)):
            choices.append(self.choice(i, toks, text, eos, req))
            completion_tokens += len(toks)
            forwards += seq.forwards
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(ids) + completion_tokens, "forwards": forwards}}

    async def stream(self, req: ChatRequest, stop_event: asyncio.Event | None = None) -> "ChatStream":
        """A `ChatStream` of a validated request, its sequences submitted: the checks that can refuse it (the
        model, the bound on sequences, the prompt's length) run first, so they answer as HTTP errors.
        stop_event: when set, the stream ends with an error event and its sequences are aborted (shutdown)."""
        self.check_model(req)
        self.reserve(req.n)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self.cpu, self.render, req)
        except BaseException:
            self.release(req.n)
            raise
        return ChatStream(self, req, ids, stop_event)

    def choice(self, index: int, toks: list[int], text: str, eos: bool, req: ChatRequest) -> dict:
        text, stopped = apply_stop(text, req.stop)
        if req.tool_choice == "none":
            message, has_calls = {"role": "assistant", "content": text, "tool_calls": None}, False
        else:
            ids = [f"call_{uuid.uuid4().hex[:16]}" for _ in range(text.count("<tool_call>"))]
            message, has_calls = assistant_message(text, ids)
        finish = "tool_calls" if has_calls else ("stop" if eos or stopped else "length")
        out = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
        if req.return_token_ids:
            out["token_ids"] = list(toks)
        return out


def stream_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The part of `text` (the decoded committed tokens of a sequence still decoding) that can be streamed now,
    and whether a stop string ended it. The answer never has to be taken back: it is cut before the earliest
    stop string (as `apply_stop` cuts the whole text) unless a stop string that starts earlier may still be
    completed by later tokens, and otherwise it holds back what later tokens could still change: a suffix that
    begins a stop string, trailing whitespace (a tokenizer may clean spaces up against the next token) and
    trailing U+FFFD (a character whose bytes are split across blocks)."""
    cut, stopped = apply_stop(text, stops)
    # a stop string starting before the cut whose text runs to the end of `text`: it may complete later
    partial = min((q for s in stops for q in range(max(0, len(text) - len(s) + 1), len(text))
                   if s.startswith(text[q:])), default=None)
    if stopped and (partial is None or len(cut) <= partial):
        return cut, True
    if partial is not None:
        cut = cut[:partial]
    return cut.rstrip("\ufffd \t\r\n\f\v"), False


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChatStream:
    """The server-sent events of one streamed request (an async iterator of `data: ...` lines).

    Each choice first gets a chunk with the role, then a content delta whenever its sequence commits a block
    (the driver's `on_block`, handed to the event loop through a queue), then, when it finishes, the rest of
    its text and a chunk with its `finish_reason` (a message with tool calls: its content and `tool_calls` in
    one delta at the end; with tools, the content comes whole at the end). A stop string ends the choice at
    once: its text stops before the stop string and its sequence is aborted. `close()` (idempotent; the app
    calls it however the response ends) aborts what still decodes and releases the request's sequences."""

    def __init__(self, service: ChatService, req: ChatRequest, ids: list[int], stop_event: asyncio.Event | None):
        self.service, self.req, self.ids, self.stop_event = service, req, ids, stop_event
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.sent = [""] * req.n  # the text streamed so far, per choice
        self.done = [False] * req.n
        self.tokens = [0] * req.n  # completion tokens, per choice
        self.closed = False
        # with tools the content is parsed whole (tool calls removed), so it is sent at the end
        self.incremental = not (req.tools and req.tool_choice != "none")
        gens = make_generators(req.n, req.seed, req.config.temperature, service.device)
        self.futures = [service.driver.submit(ids, req.config, g, req.config.max_new_tokens,
                                              on_block=self._on_block(i) if self.incremental else None)
                        for i, g in enumerate(gens)]
        for i, f in enumerate(self.futures):
            f.add_done_callback(lambda f, i=i: self._put((i, f)))

    def _put(self, item) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _on_block(self, i: int):
        return lambda seq, toks: self._put((i, list(toks)))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for f in self.futures:
            if not f.done():
                self.service.driver.abort(f)
        self.service.release(self.req.n)

    def chunk(self, index: int, delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
        return _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.service.name, "choices": [choice]})

    async def __aiter__(self):
        try:
            for i in range(self.req.n):
                yield self.chunk(i, {"role": "assistant", "content": ""})
            while not all(self.done):
                item = await self._next()
                if item is None:  # the shutdown grace ended
                    yield _sse({"error": {"message": "the server is shutting down: the request did not finish "
                                          "within the shutdown grace", "type": "server_error", "param": None,
                                          "code": "server_shutting_down"}})
                    return
                i, payload = item
                if self.done[i]:
                    continue
                out = await (self._block(i, payload) if isinstance(payload, list) else self._finished(i, payload))
                for line in out:
                    yield line
            if self.req.include_usage:
                total = sum(self.tokens)
                yield _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.service.name, "choices": [],
                            "usage": {"prompt_tokens": len(self.ids), "completion_tokens": total,
                                      "total_tokens": len(self.ids) + total}})
            yield "data: [DONE]\n\n"
        finally:
            self.close()

    async def _next(self):
        if self.stop_event is None:
            return await self.queue.get()
        get, stop = asyncio.ensure_future(self.queue.get()), asyncio.ensure_future(self.stop_event.wait())
        try:
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not get.done():
                get.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    async def _block(self, i: int, toks: list[int]) -> list[str]:
        """The delta of choice i for its committed tokens `toks` (and its end, when a stop string is in them)."""
        svc = self.service
        cut = first_eos(toks, svc.eos_ids)
        toks = toks if cut is None else toks[: cut + 1]
        text = await self.loop.run_in_executor(svc.cpu, lambda: svc.cpu_tokenizer.decode(toks,
                                                                                          skip_special_tokens=True))
        safe, stopped = stream_cut(text, self.req.stop)
        out = self._delta(i, safe)
        if stopped:
            self.done[i], self.tokens[i] = True, len(toks)
            svc.driver.abort(self.futures[i])
            out.append(self.chunk(i, {}, "stop"))
        return out

    def _delta(self, i: int, text: str) -> list[str]:
        if len(text) <= len(self.sent[i]):
            return []
        if not text.startswith(self.sent[i]):  # stream_cut holds back what could change: this would be a bug
            log.warning("ebpo serve: streamed text of choice %d is not a prefix of its text; streaming stops", i)
            return []
        delta, self.sent[i] = text[len(self.sent[i]):], text
        return [self.chunk(i, {"content": delta})]

    async def _finished(self, i: int, fut: concurrent.futures.Future) -> list[str]:
        """The rest of choice i's text and its finish_reason, from its finished sequence."""
        svc, self.done[i] = self.service, True
        try:
            seq = fut.result()
        except (concurrent.futures.CancelledError, ValueError) as e:
            return [_sse({"error": {"message": f"the sequence of choice {i} failed: {e}", "type": "server_error",
                                    "param": None, "code": "sequence_failed"}})]
        toks, text, eos = await self.loop.run_in_executor(
            svc.cpu, lambda: sequence_output(seq, svc.eos_ids, svc.cpu_tokenizer))
        self.tokens[i] = len(toks)
        choice = svc.choice(i, toks, text, eos, self.req)
        message = choice["message"]
        out = self._delta(i, message["content"] or "")
        if message["tool_calls"]:
            calls = [dict(c, index=k) for k, c in enumerate(message["tool_calls"])]
            out.append(self.chunk(i, {"tool_calls": calls}))
        extra = {"token_ids": choice["token_ids"]} if "token_ids" in choice else {}
        out.append(self.chunk(i, {}, choice["finish_reason"], **extra))
        return out
