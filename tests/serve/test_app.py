"""The app of `ebpo serve` (ebpo/serve/app.py) against hostile or careless clients, as docs/serving.md promises:
malformed bodies get a 4xx in the OpenAI error shape and the server goes on; a body over the limit is refused
while reading; only `application/json` is accepted; an API key is required when set; a large request never
stalls the other clients; a client that goes away stops costing forwards; SIGTERM drains within the grace."""
import concurrent.futures
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "Compute 482*37."}]
JSON = {"Content-Type": "application/json"}
SMALL_LIMIT = 64 * 1024


def _nest(depth: int, leaf):
    """`leaf` inside `depth` JSON objects."""
    for _ in range(depth):
        leaf = {"x": leaf}
    return leaf


def _tool(parameters):
    return {"type": "function", "function": {"name": "calc", "description": "d", "parameters": parameters}}


@pytest.fixture(scope="module")
def limited(served):
    """A second app on the same service: an API key and a 64 KiB body limit."""
    from ebpo.serve.app import BackgroundServer, create_app

    service, _, _ = served
    live = BackgroundServer(create_app(service, api_key="s3cret-key", max_body_bytes=SMALL_LIMIT))
    yield live
    live.stop()


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def _raw_http(port: int, head: bytes, body_parts, read_timeout: float = 10.0) -> bytes:
    """Send a request head and body parts on a raw socket, then read what the server answers (until it closes
    the connection or `read_timeout` passes with nothing new)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(head)
        for part in body_parts:
            try:
                s.sendall(part)
            except OSError:  # the server answered and closed: what it said is in the receive buffer
                break
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


# ---- malformed bodies: a 4xx, never a 500 or a stall

@pytest.mark.parametrize("body, param", [
    ('{"model": "tiny-agent", "messages": ' + "[" * 10_000 + "]" * 10_000 + "}", None),
    (json.dumps({"model": "tiny-agent", "messages": USER, "tools": [_tool(_nest(400, {"type": "string"}))]}), "tools"),
    (json.dumps({"model": "tiny-agent", "messages": USER, "tools": [_tool('{"type": "object"}')]}), "tools"),
    ('{"model": "tiny-agent", "messages": [{"role": "user", "content": "ab\\ud800cd"}]}', "messages"),
    ('{"model": "tiny-agent", "messages": [{"role": "user", "content": "x"}], "\\udfff": 1}', None),
    (b'{"model": "tiny-agent", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
])
def test_malformed_bodies_get_a_400_and_the_server_goes_on(served, client, body, param):
    _, _, live = served
    r = httpx.post(live.base_url + "/chat/completions", content=body, headers=JSON, timeout=30)
    err = _assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert client.models.list().data[0].id == "tiny-agent"


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(limited):
    """Content-Length of 2 GB against a 64 KiB limit: 413 at once, after only the first kilobyte was sent."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer s3cret-key\r\nContent-Length: 2000000000\r\n\r\n")
    t0 = time.monotonic()
    out = _raw_http(limited.port, head, [b'{"model": "' + b"x" * 1000], read_timeout=10)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert time.monotonic() - t0 < 5
    err = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_too_large" and str(SMALL_LIMIT) in err["message"]


def test_a_chunked_body_is_cut_at_the_limit(limited):
    """A chunked body (no Content-Length) that passes the limit is answered 413 without waiting for its end
    (the terminating chunk is never sent)."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer s3cret-key\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 16384
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (SMALL_LIMIT // len(piece) + 2)
    out = _raw_http(limited.port, head, chunks, read_timeout=10)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]


def test_a_body_under_the_limit_is_served(limited):
    """60 KB of body (most of it in `user`, a field that changes nothing) against the 64 KiB limit."""
    client = openai.OpenAI(base_url=limited.base_url, api_key="s3cret-key", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=8, user="u" * 60_000)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_four_megabyte_message_does_not_stall_the_other_clients(served):
    """4 MB of text (under the 4 MiB default limit) is refused as too long for the context without holding
    the event loop: /v1/models answers every other client meanwhile."""
    _, _, live = served
    body = json.dumps({"model": "tiny-agent", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "lorem ipsum dolor sit amet " * 150_000}]})
    assert 3_900_000 < len(body) < 4 << 20
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, live.base_url + "/chat/completions", content=body, headers=JSON, timeout=120)
        waits = []
        while not big.done() or len(waits) < 5:
            t0 = time.monotonic()
            assert httpx.get(live.base_url + "/models", timeout=10).status_code == 200
            waits.append(time.monotonic() - t0)
        _assert_openai_error(big.result(), 400, "context_length_exceeded")
    assert max(waits) < 2.0, waits


def test_tokenising_runs_off_the_event_loop(served, monkeypatch):
    """While one request's prompt takes 3 s to tokenise, /v1/models keeps answering at once."""
    import ebpo.serve.service as service_module

    _, _, live = served
    slow_render = service_module.prompt_ids

    def prompt_ids(*args, **kwargs):
        time.sleep(3.0)
        return slow_render(*args, **kwargs)

    monkeypatch.setattr(service_module, "prompt_ids", prompt_ids)
    body = json.dumps({"model": "tiny-agent", "max_tokens": 8, "messages": USER})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, live.base_url + "/chat/completions", content=body, headers=JSON, timeout=60)
        time.sleep(0.5)
        waits = []
        while not slow.done():
            t0 = time.monotonic()
            assert httpx.get(live.base_url + "/models", timeout=10).status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.1)
        assert slow.result().status_code == 200
    assert waits and max(waits) < 1.0, waits


# ---- content type and API key

@pytest.mark.parametrize("ctype, status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), (None, 415),
    ("application/json; charset=latin-1", 415), ("application/json; charset=UTF-8", 200),
    ("Application/JSON", 200),
])
def test_only_json_bodies_are_accepted(served, ctype, status):
    _, _, live = served
    headers = {} if ctype is None else {"Content-Type": ctype}
    body = json.dumps({"model": "tiny-agent", "messages": USER, "max_tokens": 8}).encode()
    r = httpx.post(live.base_url + "/chat/completions", content=body, headers=headers, timeout=60)
    if status == 415:
        _assert_openai_error(r, 415, "unsupported_media_type")
    else:
        assert r.status_code == 200 and r.json()["choices"]


def test_the_api_key_is_required_and_compared_in_constant_time(limited, monkeypatch):
    import ebpo.serve.app as app_module

    compared = []
    real = app_module.hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare_digest)
    for key in ("wrong", "s3cret-ke", "s3cret-key2"):
        bad = openai.OpenAI(base_url=limited.base_url, api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=8)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert (b"wrong", b"s3cret-key") in compared
    missing = httpx.get(limited.base_url + "/models", timeout=30)
    _assert_openai_error(missing, 401, "invalid_api_key")
    good = openai.OpenAI(base_url=limited.base_url, api_key="s3cret-key", max_retries=0, timeout=60)
    assert good.models.list().data[0].id == "tiny-agent"
    assert good.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=8).choices


# ---- a client that goes away, and shutdown: a server whose every forward takes 250 ms more

@pytest.fixture()
def slow_server():
    """(ChatService, EngineDriver, BackgroundServer with a 0.5 s shutdown grace) of tiny-agent whose forwards each
    sleep 250 ms: the long request below takes 20 forwards or more (about 69 tokens per choice), 5 s or more."""
    from ebpo.serve.app import BackgroundServer, create_app
    from ebpo.serve.cli import build_service

    service, driver = build_service("tiny-agent", max_batch=16, max_len=512)
    service.model.register_forward_pre_hook(lambda *_: time.sleep(0.25))
    live = BackgroundServer(create_app(service), grace_s=0.5)
    yield service, driver, live
    live.stop()
    driver.close()


def _long_request(live, timeout):
    body = json.dumps({"model": "tiny-agent", "messages": USER, "n": 4, "max_tokens": 400, "temperature": 1.0,
                       "seed": 0})
    return httpx.post(live.base_url + "/chat/completions", content=body, headers=JSON, timeout=timeout)


def _idle_after(driver, settle_s: float, watch_s: float = 2.0) -> bool:
    """Whether the driver runs no forward at all in the `watch_s` seconds after `settle_s` seconds (for an abort
    to take effect): a request left to decode would run one every 250 ms or so."""
    time.sleep(settle_s)
    before = driver.num_forwards
    time.sleep(watch_s)
    return driver.num_forwards == before


def test_a_client_that_goes_away_stops_costing_forwards(slow_server):
    service, driver, live = slow_server
    with pytest.raises(httpx.ReadTimeout):
        _long_request(live, timeout=1.0)
    assert driver.num_forwards > 0
    assert _idle_after(driver, settle_s=1.5), "the abandoned request is still decoding"
    # the server is fine afterwards: a fresh request is answered
    r = httpx.post(live.base_url + "/chat/completions", headers=JSON, timeout=60,
                   content=json.dumps({"model": "tiny-agent", "messages": USER, "max_tokens": 8}))
    assert r.status_code == 200


def test_shutdown_answers_what_is_in_flight_and_exits_within_the_grace(slow_server):
    service, driver, live = slow_server
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(_long_request, live, 60)
        deadline = time.monotonic() + 30
        while driver.num_forwards < 2:
            assert time.monotonic() < deadline and not inflight.done()
            time.sleep(0.05)
        t0 = time.monotonic()
        live.terminate()
        live.thread.join(10)
        exited = time.monotonic() - t0
        r = inflight.result(timeout=10)
    assert not live.thread.is_alive() and exited < 0.5 + 1.5, exited
    err = _assert_openai_error(r, 503, "server_shutting_down")
    assert err["type"] == "server_error"
    assert _idle_after(driver, settle_s=0.5), "the shut-down request is still decoding"


@pytest.mark.slow
def test_sigterm_to_ebpo_serve_exits_within_the_grace(tmp_path):
    """The real command: a warning for a non-loopback bind without a key; SIGTERM with a long request in flight
    (16 choices through 4 rows at a time: 4 rounds of 20 forwards or more) ends the process within the grace
    (1 s) and a second, the request answered 503."""
    import os

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "ebpo.cli", "serve", "--model", "tiny-agent", "--host",
                                 "0.0.0.0", "--port", str(port), "--max-len", "512", "--max-batch", "4",
                                 "--shutdown-grace-s", "1"],
                                stderr=err_file, stdout=subprocess.DEVNULL, env={**os.environ, "EBPO_API_KEY": ""})
    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            try:
                if httpx.get(base + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert "without an API key" in err_path.read_text()
        answer = {}

        def ask():
            body = json.dumps({"model": "tiny-agent", "messages": USER, "n": 16, "max_tokens": 480,
                               "temperature": 1.0, "seed": 0})
            answer["r"] = httpx.post(base + "/chat/completions", content=body, headers=JSON, timeout=60)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.terminate()
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        t.join(10)
        _assert_openai_error(answer["r"], 503, "server_shutting_down")
        assert took < 1.0 + 1.0, took
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the bound on sequences held at once

@pytest.fixture()
def bounded_server():
    """tiny-agent holding at most 4 sequences, whose forwards each sleep 250 ms (a 64-token request lasts
    seconds)."""
    from ebpo.serve.app import BackgroundServer, create_app
    from ebpo.serve.cli import build_service

    service, driver = build_service("tiny-agent", max_batch=4, max_len=512, max_sequences=4)
    service.model.register_forward_pre_hook(lambda *_: time.sleep(0.25))
    live = BackgroundServer(create_app(service))
    yield service, driver, live
    live.stop()
    driver.close()


def test_a_request_beyond_the_bound_on_sequences_is_refused_as_too_many_requests(bounded_server):
    service, driver, live = bounded_server
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(client.chat.completions.create, model="tiny-agent", messages=USER, n=3, max_tokens=64,
                           temperature=1.0, seed=0)
        deadline = time.monotonic() + 30
        while service.held < 3:
            assert time.monotonic() < deadline and not long.done()
            time.sleep(0.02)
        for stream in (False, True):  # 3 held + 2 > 4, streamed or not
            with pytest.raises(openai.RateLimitError) as err:
                client.chat.completions.create(model="tiny-agent", messages=USER, n=2, max_tokens=8, stream=stream)
            assert err.value.status_code == 429 and err.value.response.headers["retry-after"] == "1"
            assert err.value.body["code"] == "rate_limit_exceeded" and err.value.body["type"] == "rate_limit_error"
        assert not long.done(), "the long request ended before the check: make it longer"
        one = client.chat.completions.create(model="tiny-agent", messages=USER, n=1, max_tokens=8)  # 3 + 1 fits
        assert len(one.choices) == 1
        assert len(long.result(timeout=120).choices) == 3
    assert service.held == 0
    assert len(client.chat.completions.create(model="tiny-agent", messages=USER, n=4, max_tokens=8).choices) == 4
