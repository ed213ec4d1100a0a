"""ebpo.serve.service: streaming chat completions of `ebpo serve` (ChatStream in ebpo/serve/service.py,
SSEResponse in app.py), driven by the real `openai` client: the streamed text of every choice is the text of the
same request unstreamed (same seed, or greedy), it arrives block by block, a stop string cuts it, and a client that
leaves stops the decoding."""
import json
import time

import httpx
import pytest

from ebpo.serve.service import apply_stop, stream_cut

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "Compute 482*37."}]
OPEN = [{"role": "user", "content": "Tell me a story about 7 cats."}]
CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate an arithmetic expression",
                                         "parameters": {"type": "object",
                                                        "properties": {"expr": {"type": "string"}}}}}


def _by_index(chunks) -> dict:
    """index -> (concatenated content, content chunks, finish_reason, tool_calls deltas) of a chunk list."""
    out: dict = {}
    for ch in chunks:
        for c in ch.choices:
            text, n, finish, calls = out.get(c.index, ("", 0, None, []))
            assert finish is None, f"choice {c.index} got a chunk after its finish_reason"
            if c.delta.content:
                text, n = text + c.delta.content, n + 1
            calls = calls + list(c.delta.tool_calls or [])
            out[c.index] = (text, n, c.finish_reason, calls)
    return out


def test_a_greedy_stream_is_the_unstreamed_answer_block_by_block(client):
    whole = client.chat.completions.create(model="tiny-agent", messages=USER, temperature=0, max_tokens=48)
    chunks = list(client.chat.completions.create(model="tiny-agent", messages=USER, temperature=0, max_tokens=48,
                                                 stream=True))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text, n_content, finish, _ = _by_index(chunks)[0]
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason and chunks[-1].choices[0].finish_reason == finish
    assert n_content >= 3, "48 tokens in blocks of 8 should come as several deltas, not one"


def test_n_choices_stream_under_their_indices_with_their_own_seeds(client):
    kw = dict(model="tiny-agent", messages=OPEN, n=2, seed=5, temperature=2.0, max_tokens=32)
    whole = client.chat.completions.create(**kw)
    got = _by_index(client.chat.completions.create(stream=True, **kw))
    assert sorted(got) == [0, 1]
    for c in whole.choices:
        assert got[c.index][0] == c.message.content and got[c.index][2] == c.finish_reason
    assert got[0][0] != got[1][0], "two seeds, two samples"


def test_usage_comes_last_when_asked(client):
    kw = dict(model="tiny-agent", messages=USER, temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_a_stop_string_cuts_the_stream(client):
    free = client.chat.completions.create(model="tiny-agent", messages=USER, temperature=0, max_tokens=48)
    text = free.choices[0].message.content
    stop = '"arguments"'
    assert stop in text and text.index(stop) > 0, text  # the greedy answer writes a tool call
    kw = dict(model="tiny-agent", messages=USER, temperature=0, max_tokens=48, stop=[stop])
    whole = client.chat.completions.create(**kw)
    streamed, _, finish, _ = _by_index(client.chat.completions.create(stream=True, **kw))[0]
    assert streamed == whole.choices[0].message.content == text[: text.index(stop)]
    assert finish == "stop"


def test_multi_block_editing_streams_only_final_blocks(client):
    kw = dict(model="tiny-agent", messages=USER, temperature=0, max_tokens=48, extra_body={"mbe_window": 1})
    whole = client.chat.completions.create(**kw)
    streamed, _, finish, _ = _by_index(client.chat.completions.create(stream=True, **kw))[0]
    assert streamed == whole.choices[0].message.content and finish == whole.choices[0].finish_reason


def test_tool_calls_come_in_one_delta_at_the_end(client):
    kw = dict(model="tiny-agent", messages=USER, temperature=0, max_tokens=96, tools=[CALC])
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.tool_calls, whole.choices[0].message
    text, _, finish, calls = _by_index(client.chat.completions.create(stream=True, **kw))[0]
    assert finish == "tool_calls" == whole.choices[0].finish_reason
    assert text == (whole.choices[0].message.content or "")
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (k, c.function.name, json.loads(c.function.arguments)) for k, c in enumerate(whole.choices[0].message.tool_calls)]
    assert all(c.id and c.type == "function" for c in calls)


def test_refusals_are_still_http_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER, stream=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-agent", messages=USER, stream=False,
                                       stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"


@pytest.mark.parametrize("text, stops, want", [
    ("abc STOP def", ["STOP"], ("abc ", True)),
    ("abc ST", ["STOP"], ("abc", False)),  # "ST" may become STOP: held back
    ("xabc", ["abcd", "c"], ("x", False)),  # "abc" may become "abcd", which starts before "c"
    ("xabcd", ["abcd", "c"], ("x", True)),
    ("héllo wor", [], ("héllo wor", False)),
    ("héllo \ufffd", [], ("héllo", False)),  # a character split across blocks, and a space that may be cleaned up
])
def test_stream_cut_sends_only_what_cannot_change(text, stops, want):
    assert stream_cut(text, stops) == want
    safe, stopped = want
    if stopped:  # what the whole text says, when the whole text is this one
        assert apply_stop(text, stops) == want


def test_a_client_that_leaves_a_stream_stops_its_sequences(slow_stream_server):
    service, driver, live = slow_stream_server
    body = {"model": "tiny-agent", "messages": USER, "n": 2, "max_tokens": 400, "temperature": 1.0, "seed": 0,
            "stream": True}
    with httpx.stream("POST", live.base_url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = next(r.iter_lines())
        assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    deadline = time.monotonic() + 10
    while (service.held or driver.pending) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert service.held == 0 and not driver.pending, "the abandoned stream still holds its sequences"
    before = driver.num_forwards
    time.sleep(1.5)
    assert driver.num_forwards == before, "the abandoned stream is still decoding"


@pytest.fixture()
def slow_stream_server():
    """tiny-agent whose forwards each sleep 250 ms: a 400-token request decodes for many seconds."""
    from ebpo.serve.app import BackgroundServer, create_app
    from ebpo.serve.cli import build_service

    service, driver = build_service("tiny-agent", max_batch=4, max_len=512)
    service.model.register_forward_pre_hook(lambda *_: time.sleep(0.25))
    live = BackgroundServer(create_app(service), grace_s=0.5)
    yield service, driver, live
    live.stop()
    driver.close()


def test_shutdown_ends_a_stream_in_flight_with_an_error_event(slow_stream_server):
    service, driver, live = slow_stream_server
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=400, temperature=1.0,
                                            seed=0, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    t0 = time.monotonic()
    live.terminate()
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:
            pass
    live.thread.join(10)
    assert not live.thread.is_alive() and time.monotonic() - t0 < 0.5 + 1.5
    assert service.held == 0
