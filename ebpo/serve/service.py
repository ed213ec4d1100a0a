"""`ChatService`: a validated chat request -> sequences on the engine driver -> an OpenAI chat completion.

One request with `n` choices is `n` sequences of the same prompt; choice i samples with its own generator
seeded `seed + i`, exactly as `ebpo generate --seed SEED` seeds its i-th sequence, so a request with a seed
gives the tokens `ebpo generate` gives for that prompt, seed and settings. Without a seed (and temperature
> 0) each choice draws a fresh seed. All sequences of all concurrent requests go through one
`EngineDriver`: requests with the same decode settings share forwards.
"""
from __future__ import annotations

import asyncio
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

    @property
    def max_tokens_limit(self) -> int:
        return self.driver.max_len

    def render(self, req: ChatRequest) -> list[int]:
        try:
            ids = prompt_ids(self.tokenizer, req.messages, req.tools if req.tool_choice != "none" else None,
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
        ids = self.render(req)
        gens = make_generators(req.n, req.seed, req.config.temperature, self.device)
        futures = [self.driver.submit(ids, req.config, g, req.config.max_new_tokens) for g in gens]
        try:
            seqs = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except ValueError as e:  # the engine refused the sequence: it does not fit, or the model cannot decode so
            fits = "does not fit" in str(e)
            param = "messages" if fits else next((k for k in ("tau_delete", "tau_insert") if k in str(e)), None)
            raise RequestError(str(e), param, "context_length_exceeded" if fits else "unsupported_value") from None
        choices, completion_tokens, forwards = [], 0, 0
        for i, seq in enumerate(seqs):
            toks, text, eos = sequence_output(seq, self.eos_ids, self.tokenizer)
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
