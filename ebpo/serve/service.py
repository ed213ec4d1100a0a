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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import time
import uuid

import torch

from rollout.config import DecodeConfig
from rollout.steps import first_eos

from .render import assistant_message, prompt_ids
from .schema import ChatRequest, RequestError


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

    def __init__(self, model, tokenizer, driver, name: str, default: DecodeConfig):
        self.model, self.tokenizer, self.driver, self.name, self.default = model, tokenizer, driver, name, default
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

    async def complete(self, req: ChatRequest) -> dict:
        """The chat completion (OpenAI shape) of a validated request."""
        if req.model != self.name:
            raise RequestError(f"the model {req.model!r} does not exist; this server serves {self.name!r}", "model",
                               "model_not_found", status=404)
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
