"""`ChatService` and `ChatStream` (ebpo/serve/service.py) over a scripted engine driver: the driver answers each
sequence with tokens the test chose, so what is checked is the service's own work against the OpenAI chat
completion and chunk objects (fields, `finish_reason`, `usage`, `n` choices under their indices), the seeds of
`ebpo generate`, the bound on sequences held (429), the length checks, and the aborts docs/serving.md promises.
The tokenizer is tiny-agent's (one character per token); the reference texts are its own `decode`."""
import asyncio
import concurrent.futures
import json
import types

import pytest
import torch

from ebpo.serve import service as service_module
from ebpo.serve.schema import ChatRequest, RequestError
from ebpo.serve.service import (RETRY_AFTER_S, ChatService, ChatStream, apply_stop, make_generators,
                                max_token_chars, sequence_output, stream_cut)
from rollout.config import DecodeConfig

USER = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
CALC = {"type": "function", "function": {"name": "calc", "description": "d",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok():
    from ebpo.model.loading import load_model_tokenizer

    return load_model_tokenizer("tiny-agent")


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedDriver:
    """Stands in for `EngineDriver`: `submit` answers sequence k with `answers[k % len]` (ids of the
    generated part), reporting it to `on_block` in blocks of 4 first unless `finish` is False (then the future
    stays pending until `resolve(k)`). Records every submission and abort."""

    def __init__(self, answers, max_len=64, max_batch=2, finish=True, error=None, forwards=3):
        self.answers, self.max_len, self.max_batch, self.finish = answers, max_len, max_batch, finish
        self.error, self.forwards = error, forwards
        self.submitted, self.futures, self.aborted = [], [], []

    def submit(self, ids, config, gen, max_new, on_block=None):
        k = len(self.futures)
        f = concurrent.futures.Future()
        f.set_running_or_notify_cancel()  # as the driver's thread does when it takes the sequence up
        self.submitted.append(dict(ids=list(ids), config=config, gen=gen, max_new=max_new, on_block=on_block))
        self.futures.append(f)
        if self.finish:
            self.resolve(k)
        return f

    def resolve(self, k):
        s, f = self.submitted[k], self.futures[k]
        if self.error is not None:
            f.set_exception(self.error)
            return
        gen = list(self.answers[k % len(self.answers)])
        if s["on_block"] is not None:
            for b in range(0, len(gen), 4):
                s["on_block"](None, gen[: b + 4])
        pad = [0] * (s["max_new"] - len(gen))
        # the canvas runs past max_new (the driver's row is longer): what lies beyond is not the answer
        f.set_result(types.SimpleNamespace(prompt_len=len(s["ids"]), canvas=s["ids"] + gen + pad + [7, 7],
                                           max_new=s["max_new"], forwards=self.forwards + k))

    def abort(self, f):
        self.aborted.append(f)
        if not f.done():
            f.set_exception(concurrent.futures.CancelledError("aborted by the caller"))


class FakeModel(torch.nn.Module):
    def __init__(self, eos, block_size=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = types.SimpleNamespace(block_size=block_size, eos_token_id=eos)


def make_service(tok, driver, default=None, max_sequences=None, eos=None):
    model = FakeModel(tok.eos_token_id if eos is None else eos)
    return ChatService(model, tok, driver, "m", default or DecodeConfig(max_new_tokens=16), max_sequences=max_sequences)


def req(**kw) -> ChatRequest:
    kw.setdefault("config", DecodeConfig(max_new_tokens=16))
    return ChatRequest(model=kw.pop("model", "m"), messages=kw.pop("messages", USER), **kw)


def run(coro):
    return asyncio.run(coro)


# ---- pure helpers

def test_make_generators_seed_each_choice_as_ebpo_generate_does():
    assert make_generators(3, 5, 0.0, torch.device("cpu")) == [None, None, None]  # greedy: no sampling
    gens = make_generators(3, 5, 0.7, torch.device("cpu"))
    for i, g in enumerate(gens):
        want = torch.Generator().manual_seed(5 + i)
        assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=want))
    fresh = make_generators(2, None, 1.0, torch.device("cpu"))
    a, b = (torch.rand(4, generator=g) for g in fresh)
    assert not torch.equal(a, b)
    assert all(g.device.type == "cpu" for g in make_generators(1, 0, 1.0, torch.device("meta")))


def test_sequence_output_cuts_after_the_first_eos_and_keeps_it(tok):
    eos = tok.eos_token_id
    body = ids_of(tok, "ab")
    seq = types.SimpleNamespace(prompt_len=2, canvas=[9, 9] + body + [eos] + ids_of(tok, "cd") + [eos, 9], max_new=6)
    toks, text, ended = sequence_output(seq, {eos}, tok)
    assert toks == body + [eos] and text == "ab" and ended
    seq = types.SimpleNamespace(prompt_len=1, canvas=[9] + ids_of(tok, "xyz") + [eos], max_new=3)
    assert sequence_output(seq, {eos}, tok) == (ids_of(tok, "xyz"), "xyz", False)  # the EOS past max_new: length
    other = ids_of(tok, "q")[0]
    seq = types.SimpleNamespace(prompt_len=0, canvas=ids_of(tok, "pq") + [eos], max_new=3)
    assert sequence_output(seq, {eos, other}, tok) == (ids_of(tok, "pq"), "pq", True)  # any EOS id ends it


def test_max_token_chars_is_the_longest_vocabulary_entry(tok):
    assert max_token_chars(tok) == max(len(t) for t in tok.get_vocab()) == 15  # "<|endoftext|>"-like specials
    assert max_token_chars(types.SimpleNamespace(get_vocab=lambda: {"a": 0, "abcd": 1, "ab": 2})) == 4
    assert max_token_chars(types.SimpleNamespace(get_vocab=lambda: {})) == 1
    assert max_token_chars(types.SimpleNamespace(get_vocab=lambda: {"": 0})) == 1


@pytest.mark.parametrize("text, stops, want", [
    ("abc STOP def STOP", ["STOP"], ("abc ", True)),
    ("abcdef", ["ef", "cd"], ("ab", True)),  # the earliest occurrence of any stop string, not the first listed
    ("abcdef", ["zz"], ("abcdef", False)),
    ("abcdef", [], ("abcdef", False)),
    ("STOPabc", ["STOP"], ("", True)),
])
def test_apply_stop_cuts_before_the_earliest_stop(text, stops, want):
    assert apply_stop(text, stops) == want


@pytest.mark.parametrize("text, stops, want", [
    ("abc", ["abc"], ("", True)),
    ("ab", ["abc"], ("", False)),
    ("xab", ["abc"], ("x", False)),
    ("xab cd", ["zz"], ("xab cd", False)),
    ("x a", ["ab"], ("x", False)),  # "a" may become "ab"; the space before it may still be cleaned up
    ("xy \t\n", [], ("xy", False)),
    ("xy\ufffd\ufffd", [], ("xy", False)),
    ("x.STOP", ["STOP", "."], ("x", True)),
    ("ab.", ["b.c", "."], ("a", False)),  # "b." may become "b.c", which starts before "."
    ("ab.d", ["b.c", "."], ("ab", True)),
    ("xab", ["ab", "abc"], ("x", True)),  # "abc" may still complete, but starts where "ab" already stopped
    ("maX", [], ("maX", False)),  # only whitespace and U+FFFD are held back
    ("say XX", ["zz"], ("say XX", False)),
])
def test_stream_cut_holds_back_only_what_may_change(text, stops, want):
    assert stream_cut(text, stops) == want


# ---- the service: settings, checks, bound

def test_the_service_reads_its_settings_from_model_driver_and_default(tok):
    driver = ScriptedDriver([[]], max_len=40, max_batch=3)
    s = make_service(tok, driver, eos=[tok.eos_token_id, 5])
    assert s.max_sequences == 4 * 3 and s.held == 0 and s.max_tokens_limit == 40
    assert s.block_size == 8 and s.eos_ids == {tok.eos_token_id, 5} and s.eos_id == tok.eos_token_id
    assert s.max_token_chars == 15 and s.device == torch.device("cpu")
    s2 = make_service(tok, driver, default=DecodeConfig(block_size=4), max_sequences=2, eos=tok.eos_token_id)
    assert s2.max_sequences == 2 and s2.block_size == 4 and s2.eos_ids == {tok.eos_token_id}


def test_the_bound_on_sequences_is_inclusive_and_answers_429_too_many_requests(tok):
    s = make_service(tok, ScriptedDriver([[]]), max_sequences=4)
    s.reserve(3)
    s.reserve(1)  # 3 + 1 = 4 fits
    with pytest.raises(RequestError) as err:
        s.reserve(1)
    e = err.value
    assert (e.status, e.code, e.type, e.param) == (429, "rate_limit_exceeded", "rate_limit_error", None)
    assert e.headers == {"Retry-After": str(RETRY_AFTER_S)} and RETRY_AFTER_S == 1
    assert "4 of at most 4" in e.message and s.held == 4
    s.release(4)
    assert s.held == 0
    s.reserve(4)


def test_an_unknown_model_is_a_404_naming_the_served_one(tok):
    s = make_service(tok, ScriptedDriver([[]]))
    with pytest.raises(RequestError) as err:
        run(s.complete(req(model="gpt-4")))
    e = err.value
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model") and "'gpt-4'" in e.message
    assert "'m'" in e.message and s.held == 0


def test_messages_too_long_in_characters_are_refused_before_tokenising(tok, monkeypatch):
    """max_len 64, max_tokens 16: 48 tokens of room, at most 15 characters a token: 720 characters pass the
    character bound (and are then tokenised), 721 do not."""
    tokenised = []
    real = service_module.prompt_ids
    monkeypatch.setattr(service_module, "prompt_ids", lambda *a, **k: tokenised.append(1) or real(*a, **k))
    s = make_service(tok, ScriptedDriver([[]], max_len=64))
    with pytest.raises(RequestError) as err:
        s.render(req(messages=[{"role": "system", "content": "a" * 700}, {"role": "user", "content": "b" * 21}]))
    e = err.value
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages") and tokenised == []
    assert "721 characters" in e.message and "at least 49 tokens" in e.message and "48" in e.message
    with pytest.raises(RequestError) as err:  # passes the character bound, fails on its tokens
        s.render(req(messages=[{"role": "user", "content": "b" * 720}]))
    assert (err.value.code, err.value.param, err.value.status) == ("context_length_exceeded", "messages", 400)
    assert tokenised == [1]
    assert "plus max_tokens (16)" in err.value.message


def test_a_prompt_that_fits_exactly_is_rendered(tok):
    from ebpo.serve.render import prompt_ids

    want = prompt_ids(tok, USER, None, 8, tok.eos_token_id)
    s = make_service(tok, ScriptedDriver([[]], max_len=len(want) + 16))
    assert s.render(req()) == want
    s = make_service(tok, ScriptedDriver([[]], max_len=len(want) + 15))
    with pytest.raises(RequestError, match="context"):
        s.render(req())


def test_tools_reach_the_prompt_unless_tool_choice_is_none(tok, monkeypatch):
    seen = []
    real = service_module.prompt_ids
    monkeypatch.setattr(service_module, "prompt_ids", lambda t, m, tools, *a: seen.append(tools) or real(t, m, tools, *a))
    s = make_service(tok, ScriptedDriver([[]], max_len=4096))
    s.render(req(tools=[CALC]))
    s.render(req(tools=[CALC], tool_choice="none"))
    s.render(req(tools=[CALC], tool_choice="auto"))
    assert seen == [[CALC], None, [CALC]]
    with pytest.raises(RequestError) as err:  # nothing to answer: a 400 on messages, saying why
        s.render(req(messages=USER + [{"role": "assistant", "content": "x"}]))
    assert (err.value.status, err.value.param) == (400, "messages") and "nothing to answer" in err.value.message


def test_a_conversation_is_laid_out_in_the_service_s_blocks(tok):
    """A multi-turn prompt is what render.prompt_ids lays out with the service's block size and EOS filler."""
    from ebpo.serve.render import prompt_ids

    talk = USER + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    s = make_service(tok, ScriptedDriver([[]], max_len=4096), default=DecodeConfig(block_size=4))
    assert s.render(req(messages=talk)) == prompt_ids(tok, talk, None, 4, tok.eos_token_id)


# ---- a completion

def test_a_completion_has_the_openai_shape_and_usage(tok):
    eos = tok.eos_token_id
    answers = [ids_of(tok, "one") + [eos], ids_of(tok, "twotwotwotwotwotwo")[:16]]
    driver = ScriptedDriver(answers)
    s = make_service(tok, driver)
    out = run(s.complete(req(n=2, seed=3, config=DecodeConfig(max_new_tokens=16, temperature=0.5),
                             return_token_ids=True)))
    prompt = s.render(req())
    assert out["object"] == "chat.completion" and out["model"] == "m" and isinstance(out["created"], int)
    assert out["id"].startswith("chatcmpl-") and len(out["id"]) == len("chatcmpl-") + 24
    c0, c1 = out["choices"]
    assert c0 == {"index": 0, "message": {"role": "assistant", "content": "one", "tool_calls": None},
                  "finish_reason": "stop", "logprobs": None, "token_ids": answers[0]}
    assert (c1["index"], c1["message"]["content"], c1["finish_reason"]) == (1, "twotwotwotwotwot", "length")
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4 + 16,
                            "total_tokens": len(prompt) + 20, "forwards": 3 + 4}
    assert [d["ids"] for d in driver.submitted] == [prompt, prompt] and s.held == 0
    assert [d["max_new"] for d in driver.submitted] == [16, 16]
    for i, d in enumerate(driver.submitted):  # choice i samples with seed + i
        assert torch.equal(torch.rand(3, generator=d["gen"]), torch.rand(3, generator=torch.Generator().manual_seed(3 + i)))
    assert "token_ids" not in run(s.complete(req()))["choices"][0]


def test_a_stop_string_ends_a_choice_with_stop(tok):
    s = make_service(tok, ScriptedDriver([ids_of(tok, "abc STOP def")]))
    c = run(s.complete(req(stop=["STOP"])))["choices"][0]
    assert c["message"]["content"] == "abc " and c["finish_reason"] == "stop"


def test_tool_calls_come_back_unless_tool_choice_is_none(tok):
    s = make_service(tok, ScriptedDriver([ids_of(tok, "ok " + CALL)], max_len=4096))
    cfg = DecodeConfig(max_new_tokens=128)
    c = run(s.complete(req(tools=[CALC], config=cfg)))["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "ok"
    (call,) = c["message"]["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == len("call_") + 16 and call["type"] == "function"
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"expr": "1+2"}
    c = run(s.complete(req(tools=[CALC], tool_choice="none", config=cfg)))["choices"][0]
    assert c["message"] == {"role": "assistant", "content": "ok " + CALL, "tool_calls": None}
    assert c["finish_reason"] == "length"


@pytest.mark.parametrize("message, param, code", [
    ("the sequence does not fit the canvas", "messages", "context_length_exceeded"),
    ("tau_insert needs a model with INSERT", "tau_insert", "unsupported_value"),
    ("tau_delete needs a model with DELETE", "tau_delete", "unsupported_value"),
    ("something else", None, "unsupported_value"),
])
def test_an_engine_refusal_is_a_400_bad_request(tok, message, param, code):
    s = make_service(tok, ScriptedDriver([[]], error=ValueError(message)))
    with pytest.raises(RequestError) as err:
        run(s.complete(req(n=2)))
    e = err.value
    assert (e.status, e.param, e.code, e.message) == (400, param, code, message) and s.held == 0


def test_a_cancelled_completion_aborts_its_sequences_and_releases_them(tok):
    driver = ScriptedDriver([[]], finish=False)
    s = make_service(tok, driver)

    async def main():
        task = asyncio.ensure_future(s.complete(req(n=3)))
        while len(driver.futures) < 3:
            await asyncio.sleep(0.01)
        assert s.held == 3
        driver.resolve(1)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert driver.aborted == [driver.futures[0], driver.futures[2]] and s.held == 0


# ---- a stream

def _events(lines):
    out = []
    for line in lines:
        assert line.startswith("data: ") and line.endswith("\n\n")
        out.append(line[6:-2] if line == "data: [DONE]\n\n" else json.loads(line[6:-2]))
    return out


def _stream(s, r, stop_event=None, drive=None):
    async def main():
        stream = await s.stream(r, stop_event)
        lines = []
        async for line in stream:
            lines.append(line)
            if drive:
                drive(len(lines))
        return stream, lines

    return asyncio.run(main())


def test_a_stream_sends_role_deltas_finish_usage_and_done(tok):
    eos = tok.eos_token_id
    answers = [ids_of(tok, "hello world") + [eos], ids_of(tok, "abcdefghijklmnop")]
    s = make_service(tok, ScriptedDriver(answers), default=DecodeConfig(max_new_tokens=8))
    cfg = DecodeConfig(max_new_tokens=16)
    stream, lines = _stream(s, req(n=2, config=cfg, include_usage=True, return_token_ids=True))
    events = _events(lines)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    prompt = len(s.render(req(config=cfg)))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": prompt, "completion_tokens": 12 + 16,
                                                         "total_tokens": prompt + 28}
    assert {k: usage[k] for k in ("id", "object", "created", "model")} == {
        "id": stream.id, "object": "chat.completion.chunk", "created": stream.created, "model": "m"}
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == stream.id and c["model"] == "m"
               and c["created"] == stream.created and len(c["choices"]) == 1 for c in chunks)
    assert stream.id.startswith("chatcmpl-")
    for i, want, finish in ((0, "hello world", "stop"), (1, "abcdefghijklmnop", "length")):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[0]["finish_reason"] is None
        assert all(c["logprobs"] is None for c in mine)
        contents = [c["delta"]["content"] for c in mine[1:-1]]
        assert "".join(contents) == want and len(contents) >= 2, contents  # block by block
        assert all(contents), "a content delta with no content"
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == finish
        assert mine[-1]["token_ids"] == answers[i]
    assert s.held == 0 and stream.closed


def test_a_stream_without_usage_ends_with_done(tok):
    s = make_service(tok, ScriptedDriver([ids_of(tok, "abc")]))
    _, lines = _stream(s, req())
    events = _events(lines)
    assert events[-1] == "[DONE]" and all(e == "[DONE]" or e["choices"] for e in events)
    assert "token_ids" not in events[-2]["choices"][0]


@pytest.mark.parametrize("before, after", [("", "xyz"), ("ab", "zz"), ("abcd", "wxyz"), ("abc", "")])
def test_nothing_after_the_eos_is_ever_streamed(tok, before, after):
    """The tokens a block commits after the EOS are not part of the answer (`sequence_output` cuts them): no
    delta may carry them, whatever the EOS's place in the block."""
    eos = tok.eos_token_id
    answer = ids_of(tok, before) + [eos] + ids_of(tok, after)
    s = make_service(tok, ScriptedDriver([answer]))
    choices = [e["choices"][0] for e in _events(_stream(s, req())[1]) if e != "[DONE]"]
    assert "".join(c["delta"].get("content") or "" for c in choices) == before
    assert choices[-1]["finish_reason"] == "stop"


def test_all_tokenising_runs_in_the_service_s_own_thread(tok, monkeypatch):
    """docs/serving.md: tokenising runs in the service's tokenising thread, on its own copy of the tokenizer."""
    threads = []
    s = make_service(tok, ScriptedDriver([ids_of(tok, "hello world") + [tok.eos_token_id]]))
    assert s.cpu_tokenizer is not tok
    # its own copy all the way down: the fast (Rust) tokenizer behind it is not shared between threads
    assert getattr(s.cpu_tokenizer, "_tokenizer", None) is not getattr(tok, "_tokenizer", None)
    for name in ("decode", "apply_chat_template", "__call__"):
        real = getattr(type(s.cpu_tokenizer), name)

        def spy(self, *a, _real=real, **k):
            import threading

            threads.append(threading.current_thread().name)
            return _real(self, *a, **k)

        monkeypatch.setattr(type(s.cpu_tokenizer), name, spy)
    run(s.complete(req()))
    _stream(s, req())
    assert threads and all(t.startswith("ebpo-serve-tokenize") for t in threads), set(threads)


def test_a_streamed_text_that_would_be_taken_back_is_logged(tok, caplog):
    """If the final text does not continue what was streamed (stream_cut's promise broken), nothing is taken
    back: a warning names the choice and the choice still ends with its finish_reason."""
    class Rewriting(ScriptedDriver):
        def resolve(self, k):
            self.submitted[k]["on_block"](None, ids_of(tok, "abcd"))
            self.answers = [ids_of(tok, "vwxyz") + [tok.eos_token_id]]
            self.submitted[k]["on_block"] = None
            super().resolve(k)

    s = make_service(tok, Rewriting([[]]))
    with caplog.at_level("WARNING", logger="ebpo.serve"):
        choices = [e["choices"][0] for e in _events(_stream(s, req(n=1))[1]) if e != "[DONE]"]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "abcd"
    assert choices[-1]["finish_reason"] == "stop"
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "ebpo.serve"]
    assert "choice 0 " in warning and "not a prefix" in warning


def test_concurrent_requests_tokenise_one_at_a_time(tok, monkeypatch):
    """One tokenising thread: the renders of concurrent requests never overlap."""
    import threading
    import time

    active, most = [0], [0]
    lock = threading.Lock()
    real = service_module.prompt_ids

    def prompt_ids(*a, **k):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return real(*a, **k)

    monkeypatch.setattr(service_module, "prompt_ids", prompt_ids)
    s = make_service(tok, ScriptedDriver([ids_of(tok, "ok")]))

    async def main():
        return await asyncio.gather(*(s.complete(req()) for _ in range(4)))

    assert len(run(main())) == 4 and most[0] == 1


def test_a_greedy_request_samples_with_no_generator(tok):
    driver = ScriptedDriver([ids_of(tok, "ok")])
    s = make_service(tok, driver)
    run(s.complete(req(n=2, seed=1, config=DecodeConfig(max_new_tokens=16, temperature=0.0))))
    assert [d["gen"] for d in driver.submitted] == [None, None]


def test_a_greedy_stream_samples_with_no_generator_and_tool_choice_none_streams_by_block(tok):
    driver = ScriptedDriver([ids_of(tok, "ok")])
    s = make_service(tok, driver)
    _stream(s, req(n=2, seed=1, config=DecodeConfig(max_new_tokens=16, temperature=0.0)))
    assert [d["gen"] for d in driver.submitted] == [None, None]
    _stream(s, req(tools=[CALC], tool_choice="none"))
    assert driver.submitted[-1]["on_block"] is not None  # tools unused: the content streams block by block


def test_a_failed_choice_adds_no_completion_tokens(tok):
    s = make_service(tok, ScriptedDriver([[]], error=ValueError("boom")))
    events = _events(_stream(s, req(n=2, include_usage=True))[1])
    assert events[-2]["usage"]["completion_tokens"] == 0


def test_a_stop_string_ends_the_streamed_choice_and_aborts_it(tok):
    driver = ScriptedDriver([ids_of(tok, "abcdSTOPefghijkl")], finish=False)
    s = make_service(tok, driver)

    def drive(n):
        if n == 1:
            driver.resolve(0)

    _, lines = _stream(s, req(stop=["STOP"]), drive=drive)
    events = _events(lines)
    choices = [e["choices"][0] for e in events if e != "[DONE]"]
    assert "".join(c["delta"].get("content", "") for c in choices) == "abcd"
    assert choices[-1]["finish_reason"] == "stop" and sum(c["finish_reason"] is not None for c in choices) == 1
    assert driver.aborted and driver.aborted[0] is driver.futures[0]


def test_a_choice_stopped_early_does_not_end_the_others(tok):
    """Choice 0 meets its stop string while choice 1 still decodes: choice 1 is still streamed to its end."""
    driver = ScriptedDriver([ids_of(tok, "abcdSTOPefghijkl"), ids_of(tok, "the other one")], finish=False)
    s = make_service(tok, driver)

    def drive(n):
        if n == 2:  # both role chunks sent
            driver.resolve(0)
            driver.resolve(1)

    events = _events(_stream(s, req(n=2, stop=["STOP"]), drive=drive)[1])
    assert events[-1] == "[DONE]"
    finish = {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[:-1]
              if e["choices"][0]["finish_reason"]}
    assert finish == {0: "stop", 1: "length"}
    text1 = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"][0]["index"] == 1)
    assert text1 == "the other one"


def test_a_streamed_tool_call_comes_whole_at_the_end(tok):
    driver = ScriptedDriver([ids_of(tok, "ok " + CALL)], max_len=4096)
    s = make_service(tok, driver)
    _, lines = _stream(s, req(tools=[CALC], config=DecodeConfig(max_new_tokens=128)))
    assert driver.submitted[0]["on_block"] is None  # content parsed whole: nothing sent block by block
    choices = [e["choices"][0] for e in _events(lines) if e != "[DONE]"]
    assert [c["delta"] for c in choices[1:2]] == [{"content": "ok"}]
    (call,) = choices[2]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "calc" and call["id"].startswith("call_")
    assert choices[3] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert len(choices) == 4


def test_a_failed_sequence_is_an_error_event(tok):
    s = make_service(tok, ScriptedDriver([[]], error=ValueError("boom")))
    events = _events(_stream(s, req())[1])
    err = events[1]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] is None
    assert err["code"] == "sequence_failed" and err["type"] == "server_error" and "boom" in err["message"]
    assert "choice 0" in err["message"] and events[-1] == "[DONE]" and s.held == 0


def test_the_shutdown_event_ends_a_stream_with_an_error_and_aborts(tok):
    driver = ScriptedDriver([[]], finish=False)
    s = make_service(tok, driver)

    async def main():
        stop = asyncio.Event()
        stream = await s.stream(req(n=2), stop)
        lines = []
        async for line in stream:
            lines.append(line)
            if len(lines) == 2:
                stop.set()
        return lines

    events = _events(run(main()))
    assert len(events) == 3 and events[2]["error"]["code"] == "server_shutting_down"
    assert set(events[2]["error"]) == {"message", "type", "param", "code"} and events[2]["error"]["param"] is None
    assert events[2]["error"]["type"] == "server_error" and "[DONE]" not in events
    assert driver.aborted == driver.futures and s.held == 0


def test_a_stream_refused_before_its_first_event_holds_nothing(tok):
    s = make_service(tok, ScriptedDriver([[]], max_len=20), max_sequences=2)
    with pytest.raises(RequestError) as err:
        run(s.stream(req(messages=[{"role": "user", "content": "x" * 400}])))
    assert err.value.code == "context_length_exceeded" and s.held == 0
    with pytest.raises(RequestError) as err:
        run(s.stream(req(n=3)))
    assert err.value.status == 429 and s.held == 0
    with pytest.raises(RequestError):
        run(s.stream(req(model="x")))
    assert s.held == 0


def test_close_is_idempotent_and_aborts_what_still_decodes(tok):
    driver = ScriptedDriver([[]], finish=False)
    s = make_service(tok, driver)

    async def main():
        stream = await s.stream(req(n=2))
        driver.resolve(0)
        stream.close()
        stream.close()
        return stream

    stream = run(main())
    assert driver.aborted == [driver.futures[1]] and s.held == 0 and stream.closed
    assert isinstance(stream, ChatStream)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_make_generators_sample_on_a_cuda_device():
    """On a GPU the choices' generators live on the model's device (where the engine samples)."""
    gens = make_generators(2, 3, 1.0, torch.device("cuda", 0))
    assert all(g.device.type == "cuda" for g in gens)
    for i, g in enumerate(gens):
        want = torch.Generator(device="cuda").manual_seed(3 + i)
        assert torch.equal(torch.rand(4, generator=g, device="cuda"), torch.rand(4, generator=want, device="cuda"))
