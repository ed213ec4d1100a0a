"""The HTTP layer of `ebpo serve` (ebpo/serve/app.py) on its own, without a model: the checks that run before
any work (API key, content type, body size), the OpenAI error shape of every refusal, the drain state, the
supervision of a request whose client leaves or whose shutdown grace ends, and the SSE response. The service is
a stand-in that records what it was asked; what is checked is what docs/serving.md ("Limits", "Shutdown") and
the OpenAI API reference say the server answers."""
import asyncio
import json
import threading
import time

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from ebpo.serve import app as app_module
from ebpo.serve.app import (BackgroundServer, GracefulServer, SSEResponse, Shutdown, check_api_key,
                            check_json_content_type, create_app, read_body, read_json, supervise)
from ebpo.serve.schema import DEFAULT_MAX_BODY_BYTES, RequestError
from rollout.config import DecodeConfig

BODY = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ERROR_KEYS = {"message", "type", "param", "code"}


class EchoService:
    """Stands in for `ChatService`: answers each request with a fixed completion and records what it got.
    `fail` (an exception) is raised instead; `stream` exists only when `streams` is given."""

    name = "echo"
    max_tokens_limit = 64

    def __init__(self, fail: BaseException | None = None):
        self.default = DecodeConfig()
        self.fail, self.requests = fail, []

    async def complete(self, req):
        self.requests.append(req)
        if self.fail is not None:
            raise self.fail
        return {"object": "chat.completion", "model": req.model, "choices": []}


class FakeStream:
    """A `ChatStream` stand-in: two events, then `[DONE]`; records `close()` calls."""

    def __init__(self):
        self.closed = 0

    async def __aiter__(self):
        yield 'data: {"a": 1}\n\n'
        yield "data: [DONE]\n\n"

    def close(self):
        self.closed += 1


class StreamingService(EchoService):
    """Streams `FakeStream`s, after `setup_s` seconds of set-up (tokenising the prompt), or never (None)."""

    def __init__(self, setup_s: float | None = 0.05):
        super().__init__()
        self.setup_s, self.streams, self.stop_events, self.cancelled = setup_s, [], [], 0

    async def stream(self, req, stop_event=None):
        self.requests.append(req)
        self.stop_events.append(stop_event)
        try:
            await asyncio.sleep(self.setup_s if self.setup_s is not None else 3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.streams.append(FakeStream())
        return self.streams[-1]


def _request(headers: dict | None = None, messages=(), method: str = "POST") -> tuple[Request, list]:
    """A Starlette request with `headers` whose `receive` hands out `messages` in order (then waits forever);
    the list returned records each message handed out."""
    got, pending = [], list(messages)

    async def receive():
        if not pending:
            await asyncio.Event().wait()
        got.append(pending.pop(0))
        return got[-1]

    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": raw, "query_string": b""}
    return Request(scope, receive), got


def _body(*parts: bytes):
    """`http.request` messages carrying `parts` (the last one ends the body)."""
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


def _error_of(r, status: int, code=None, type_="invalid_request_error") -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"] and err["type"] == type_
    if code is not None:
        assert err["code"] == code
    return err


def _client(service=None, **kw) -> TestClient:
    return TestClient(create_app(service or EchoService(), **kw), raise_server_exceptions=False)


# ---- the API key: `Authorization: Bearer KEY`, 401 `invalid_api_key` otherwise (docs/serving.md, "Limits")

@pytest.mark.parametrize("header, ok", [
    (None, False), ("", False), ("Bearer wrong", False), ("Bearer s3cret-ke", False), ("Bearer s3cret-key2", False),
    ("Basic s3cret-key", False), ("Bearers3cret-key", False), ("s3cret-key", False), ("Bearer", False),
    ("Bearer s3cret-key", True), ("bearer s3cret-key", True), ("BEARER s3cret-key", True),  # RFC 7235: any case
    ("Bearer s3cret-key ", True), ("Bearer  s3cret-key", True),  # whitespace around the token is not the token
])
def test_the_api_key_is_read_from_a_bearer_authorization(header, ok):
    request, _ = _request({} if header is None else {"Authorization": header})
    if ok:
        assert check_api_key(request, "s3cret-key") is None
        return
    with pytest.raises(RequestError) as err:
        check_api_key(request, "s3cret-key")
    e = err.value
    assert (e.status, e.code, e.type, e.param) == (401, "invalid_api_key", "invalid_request_error", None)
    assert "Authorization: Bearer" in e.message


def test_without_a_key_every_request_passes():
    for headers in ({}, {"Authorization": "Bearer anything"}, {"Authorization": "junk"}):
        assert check_api_key(_request(headers)[0], None) is None


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    real = app_module.hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    with pytest.raises(RequestError):
        check_api_key(_request({"Authorization": "Bearer s3cret-kez"})[0], "s3cret-key")
    check_api_key(_request({"Authorization": "Bearer s3cret-key"})[0], "s3cret-key")
    assert compared == [(b"s3cret-kez", b"s3cret-key"), (b"s3cret-key", b"s3cret-key")]


def test_the_key_guards_every_route_of_the_app():
    client = _client(api_key="k", complete=lambda request, req: _answer(request))
    for path in ("/v1/models", "/episodes/3/v1/models"):
        _error_of(client.get(path), 401, "invalid_api_key")
        assert client.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
    for path in ("/v1/chat/completions", "/episodes/3/v1/chat/completions"):
        _error_of(client.post(path, json=BODY), 401, "invalid_api_key")
        assert client.post(path, json=BODY, headers={"Authorization": "Bearer k"}).status_code == 200


async def _answer(request):
    return {"episode": request.path_params.get("episode")}


# ---- content type: application/json with no charset or utf-8, 415 `unsupported_media_type` otherwise

@pytest.mark.parametrize("ctype", [
    "application/json", "Application/JSON", "application/json; charset=utf-8", "application/json;charset=UTF-8",
    'application/json; charset="utf-8"', "application/json; charset=utf8", "application/json; Charset = UTF-8",
    "application/json ; charset=utf-8", "application/json; boundary=x",
])
def test_json_content_types_are_accepted(ctype):
    assert check_json_content_type(_request({"Content-Type": ctype})[0]) is None


@pytest.mark.parametrize("ctype", [
    None, "", "text/plain", "text/json", "application/jsonx", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/json; charset=utf-16",
    "application/json; charset=utf-8; charset=latin-1", "application/json; charset=",
    "application/json; charset=Xutf-8X", "application/json; charset=x=utf-8",  # not utf-8 either
])
def test_other_content_types_get_415_unsupported_media_type(ctype):
    request, _ = _request({} if ctype is None else {"Content-Type": ctype})
    with pytest.raises(RequestError) as err:
        check_json_content_type(request)
    e = err.value
    assert (e.status, e.code, e.type, e.param) == (415, "unsupported_media_type", "invalid_request_error", None)
    media = (ctype or "").split(";")[0].strip()
    assert repr(media or "none") in e.message and "application/json" in e.message


def test_the_app_refuses_a_text_plain_chat_body_before_calling_the_service():
    service = EchoService()
    r = _client(service).post("/v1/chat/completions", content=json.dumps(BODY), headers={"Content-Type": "text/plain"})
    _error_of(r, 415, "unsupported_media_type")
    assert service.requests == []


# ---- the body limit: 413 `request_too_large`, a declared length refused before reading

def _read(request, limit):
    return asyncio.run(read_body(request, limit))


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    request, got = _request({"Content-Length": "11"}, _body(b"x" * 11))
    with pytest.raises(RequestError) as err:
        _read(request, 10)
    e = err.value
    assert (e.status, e.code, e.param) == (413, "request_too_large", None) and "10 bytes" in e.message
    assert got == [], "the body was read before the declared length was checked"


@pytest.mark.parametrize("declared", ["abc", "-1", "1e3", "", "0x10"])
def test_a_content_length_that_is_not_a_number_is_a_400_bad_request(declared):
    request, got = _request({"Content-Length": declared}, _body(b"{}"))
    with pytest.raises(RequestError) as err:
        _read(request, 100)
    assert (err.value.status, err.value.code) == (400, "invalid_request") and got == []
    assert isinstance(err.value.message, str) and "Content-Length" in err.value.message


def test_a_body_of_exactly_the_limit_is_read_whole():
    parts = (b"abcd", b"efgh", b"ij")
    assert _read(_request({"Content-Length": "10"}, _body(*parts))[0], 10) == b"abcdefghij"
    assert _read(_request({"Content-Length": " 10 "}, _body(*parts))[0], 10) == b"abcdefghij"
    assert _read(_request({}, _body(*parts))[0], 10) == b"abcdefghij"  # chunked: no Content-Length
    assert _read(_request({}, _body(b""))[0], 0) == b""


def test_a_chunked_body_is_cut_as_soon_as_it_passes_the_limit():
    request, got = _request({}, _body(b"a" * 4, b"b" * 4, b"c" * 4, b"d" * 4, b"e"))
    with pytest.raises(RequestError) as err:
        _read(request, 10)
    assert (err.value.status, err.value.code) == (413, "request_too_large")
    assert len(got) == 3, "reading went on past the chunk that crossed the limit"


def test_a_client_gone_while_sending_the_body_is_a_clean_error():
    request, _ = _request({}, _body(b"ab", b"cd")[:1] + [{"type": "http.disconnect"}])
    with pytest.raises(RequestError) as err:
        _read(request, 100)
    assert err.value.code == "client_closed" and err.value.status == 400


def test_read_json_decodes_in_a_worker_thread(monkeypatch):
    threads = []
    real = app_module.decode_body
    monkeypatch.setattr(app_module, "decode_body", lambda raw: threads.append(threading.get_ident()) or real(raw))
    request, _ = _request({}, _body(b'{"a": [1, ', b'"\\u00e9"]}'))
    assert asyncio.run(read_json(request)) == {"a": [1, "é"]}
    assert threads and threads[0] != threading.get_ident()
    with pytest.raises(RequestError) as err:
        asyncio.run(read_json(_request({}, _body(b'{"a": '))[0]))
    assert err.value.code == "invalid_json"


def test_read_json_has_the_documented_default_limit():
    """4 MiB (docs/serving.md, `--max-body-mb`): a declared length one byte more is refused, exactly 4 MiB is not."""
    assert DEFAULT_MAX_BODY_BYTES == 4 << 20
    with pytest.raises(RequestError) as err:
        asyncio.run(read_json(_request({"Content-Length": str((4 << 20) + 1)}, _body(b"{}"))[0]))
    assert err.value.status == 413
    assert asyncio.run(read_json(_request({"Content-Length": str(4 << 20)}, _body(b"{}"))[0])) == {}


def test_the_app_applies_its_body_limit_and_closes_the_connection():
    body = json.dumps(BODY).encode()
    service = EchoService()
    small = _client(service, max_body_bytes=len(body) - 1)
    r = small.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    _error_of(r, 413, "request_too_large")
    assert r.headers["connection"] == "close" and service.requests == []
    fits = _client(service, max_body_bytes=len(body))
    assert fits.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}).json() == {
        "object": "chat.completion", "model": "echo", "choices": []}


# ---- routes, and errors in the OpenAI shape

def test_models_lists_the_served_model_as_an_openai_model_object():
    t0 = int(time.time())
    r = _client().get("/v1/models")
    t1 = int(time.time())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert set(model) == {"id", "object", "created", "owned_by"}
    assert (model["id"], model["object"], model["owned_by"]) == ("echo", "model", "ebpo")
    assert isinstance(model["created"], int) and t0 <= model["created"] <= t1  # Unix seconds


def test_unknown_routes_and_methods_get_openai_shaped_errors():
    client = _client()
    err = _error_of(client.get("/v1/nope"), 404, type_="not_found_error")
    assert err["message"].startswith("GET /v1/nope: ") and err["param"] is None and err["code"] is None
    err = _error_of(client.get("/v1/chat/completions"), 405)
    assert err["message"].startswith("GET /v1/chat/completions: ")
    _error_of(client.get("/episodes/1/v1/models"), 404, type_="not_found_error")  # only with `complete`


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_the_app_serves_no_schema_or_docs_pages(path):
    """Only the routes of the OpenAI API exist: no generated schema or docs pages to crawl."""
    _error_of(_client().get(path), 404, type_="not_found_error")


def test_a_server_fault_is_a_500_and_the_server_goes_on():
    service = EchoService(fail=RuntimeError("boom " + "x" * 500))
    client = _client(service)
    err = _error_of(client.post("/v1/chat/completions", json=BODY), 500, type_="server_error")
    assert err["message"].startswith("internal error: RuntimeError: boom ")
    assert len(err["message"]) == len("internal error: RuntimeError: ") + 200  # the exception's text is cut
    assert (err["param"], err["code"]) == (None, None)
    service.fail = None
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    assert client.get("/v1/models").status_code == 200


def test_a_refusal_keeps_its_status_fields_and_headers():
    service = EchoService(fail=RequestError("busy", "n", "rate_limit_exceeded", status=429, type="rate_limit_error",
                                            headers={"Retry-After": "1"}))
    r = _client(service).post("/v1/chat/completions", json=BODY)
    err = _error_of(r, 429, "rate_limit_exceeded", type_="rate_limit_error")
    assert err == {"message": "busy", "type": "rate_limit_error", "param": "n", "code": "rate_limit_exceeded"}
    assert r.headers["retry-after"] == "1" and "close" not in r.headers.get("connection", "")


def test_the_request_is_validated_against_the_service_settings():
    service = EchoService()
    client = _client(service)
    _error_of(client.post("/v1/chat/completions", json={**BODY, "max_tokens": 65}), 400)  # over max_tokens_limit
    assert client.post("/v1/chat/completions", json={**BODY, "max_tokens": 64}).status_code == 200
    assert service.requests[-1].config.max_new_tokens == 64
    assert service.requests[-1].config.tau_mask == service.default.tau_mask
    assert len(service.requests) == 1


def test_the_gateway_routes_go_to_complete_with_the_path():
    seen = []

    async def complete(request, req):
        seen.append((request.path_params.get("episode"), req.model))
        return {"ok": True}

    service = EchoService()
    client = _client(service, complete=complete)
    assert client.post("/episodes/ep-7/v1/chat/completions", json=BODY).json() == {"ok": True}
    assert client.post("/v1/chat/completions", json=BODY).json() == {"ok": True}
    assert client.get("/episodes/ep-7/v1/models").json()["data"][0]["id"] == "echo"
    assert seen == [("ep-7", "echo"), (None, "echo")] and service.requests == []
    err = _error_of(client.post("/v1/chat/completions", json={**BODY, "stream": True}), 400, "unsupported_parameter")
    assert err["param"] == "stream"


def test_stream_is_refused_by_a_service_that_cannot_stream():
    err = _error_of(_client().post("/v1/chat/completions", json={**BODY, "stream": True}), 400,
                    "unsupported_parameter")
    assert err["param"] == "stream"


def test_a_stream_is_sent_as_server_sent_events_and_closed_at_the_end():
    service = StreamingService()
    app = create_app(service)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    assert r.text == 'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert [s.closed for s in service.streams] == [1]
    (req,) = service.requests
    assert req.stream and req.model == "echo" and req.config.max_new_tokens == 4
    assert isinstance(service.stop_events[0], asyncio.Event) and not service.stop_events[0].is_set()


def test_a_client_gone_while_a_stream_is_set_up_gets_499_and_the_set_up_stops():
    """Raw ASGI: the body, then the client's disconnect while the service still prepares the stream."""
    service = StreamingService(setup_s=None)
    app = create_app(service)
    sent, messages = [], _body(json.dumps({**BODY, "stream": True}).encode()) + [{"type": "http.disconnect"}]

    async def receive():
        await asyncio.sleep(0.05)
        return messages.pop(0) if messages else await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "client_closed" and service.cancelled == 1 and service.streams == []


def test_shutdown_grace_ends_a_stream_still_being_set_up_with_503_unavailable():
    import httpx

    service = StreamingService(setup_s=None)
    live = BackgroundServer(create_app(service), grace_s=0.3)
    try:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
            live.base_url + "/chat/completions", json={**BODY, "stream": True}, timeout=30)))
        t.start()
        deadline = time.monotonic() + 10
        while not service.requests:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        live.terminate()
        t.join(10)
        _error_of(out["r"], 503, "server_shutting_down", type_="server_error")
        assert service.cancelled == 1
    finally:
        live.stop()


def test_sse_response_closes_the_stream_when_sending_fails():
    stream = FakeStream()

    async def send(message):
        raise OSError("gone")

    async def receive():
        await asyncio.Event().wait()

    with pytest.raises(Exception):  # noqa: B017 - the OSError, alone or in an exception group
        asyncio.run(SSEResponse(stream)({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert stream.closed == 1


# ---- drain state and supervision

def test_shutdown_begins_closing_and_expires_after_the_grace():
    async def main():
        s = Shutdown()
        assert not s.closing and not s.expired().is_set()
        assert s.expired() is s.expired()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        s.begin(0.3)
        assert s.closing and not s.expired().is_set()
        s.begin(0.0)  # a second signal does not cut the grace short
        await asyncio.wait_for(s.expired().wait(), 10.0)
        # the loop's timers never fire early (a slow machine only makes them late)
        assert loop.time() - t0 >= 0.3 - 0.01, "expired before the grace"

    asyncio.run(main())


def test_a_negative_grace_expires_at_once_and_each_loop_gets_its_own_event():
    s = Shutdown()

    async def first():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        s.begin(-5.0)  # no grace: requests in flight are answered 503 at the next turn of the loop
        await asyncio.wait_for(s.expired().wait(), 5.0)
        assert loop.time() - t0 < 0.9, "a grace of 0 waited as if it were a second"
        return s.expired()

    ev = asyncio.run(first())

    async def second():
        return s.expired()

    assert asyncio.run(second()) is not ev


def _supervised(work_coro, messages=(), shutdown=None, expire_after=None):
    """(result or exception, whether `work` was cancelled, the receive log) of `supervise` over `work_coro`."""
    async def main():
        request, got = _request({}, messages)
        state = {"cancelled": False}

        async def work():
            try:
                return await work_coro
            except asyncio.CancelledError:
                state["cancelled"] = True
                raise

        if expire_after is not None:
            shutdown.begin(expire_after)
        task = asyncio.ensure_future(work())
        try:
            out = await supervise(request, task, shutdown)
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            out = e
        # when the answer is given, the work has already stopped (its cancellation handled, sequences aborted)
        assert task.done()
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return out, state["cancelled"], got, others

    return asyncio.run(main())


async def _after(seconds, value):
    await asyncio.sleep(seconds)
    return value


def test_supervise_returns_the_work_and_leaves_nothing_running():
    out, cancelled, got, others = _supervised(_after(0.01, {"x": 1}), shutdown=Shutdown())
    assert out == {"x": 1} and not cancelled and others == []


def test_supervise_cancels_the_work_of_a_client_that_left():
    out, cancelled, got, others = _supervised(
        _after(30, "never"), [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}])
    assert cancelled and others == [] and len(got) == 2
    assert out.status_code == 499
    assert json.loads(out.body)["error"] == {"message": "the client closed the request", "type": "invalid_request_error",
                                             "param": None, "code": "client_closed"}


def test_supervise_answers_503_when_the_grace_ends_first():
    out, cancelled, _, others = _supervised(_after(30, "never"), shutdown=Shutdown(), expire_after=0.05)
    assert cancelled and others == []
    assert isinstance(out, RequestError)
    assert (out.status, out.code, out.type) == (503, "server_shutting_down", "server_error")
    assert "shutting down" in out.message and "grace" in out.message


def test_supervise_passes_on_the_work_s_error():
    async def fail():
        raise RequestError("nope", "model", "model_not_found", status=404)

    out, cancelled, _, others = _supervised(fail(), shutdown=Shutdown())
    assert isinstance(out, RequestError) and out.code == "model_not_found" and not cancelled and others == []


def test_a_closing_app_refuses_new_requests_with_503_unavailable():
    service = EchoService()
    app = create_app(service)
    app.state.shutdown.closing = True
    client = TestClient(app, raise_server_exceptions=False)
    err = _error_of(client.post("/v1/chat/completions", json=BODY), 503, "server_shutting_down", type_="server_error")
    assert err["param"] is None and service.requests == [] and "shutting down" in err["message"]


# ---- the server: a free port, drain on SIGTERM

def test_graceful_server_gives_uvicorn_a_backstop_after_the_grace():
    import uvicorn

    server = GracefulServer(uvicorn.Config(create_app(EchoService())), grace_s=3)
    assert server.grace_s == 3.0 and isinstance(server.grace_s, float)
    assert server.config.timeout_graceful_shutdown == 5.0


def test_a_second_sigint_forces_the_exit():
    import signal

    import uvicorn

    server = GracefulServer(uvicorn.Config(create_app(EchoService())), grace_s=1)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit
    term = GracefulServer(uvicorn.Config(create_app(EchoService())), grace_s=1)
    term.handle_exit(signal.SIGTERM, None)
    term.handle_exit(signal.SIGTERM, None)
    assert term.should_exit and not term.force_exit


def test_stop_waits_for_the_server_thread_at_most_its_timeout():
    live = BackgroundServer(create_app(EchoService()))
    server_thread, stuck = live.thread, threading.Event()
    live.thread = threading.Thread(target=stuck.wait, daemon=True)  # a server thread that never ends
    live.thread.start()
    t0 = time.monotonic()
    live.stop(timeout_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 3.0 and live.server.should_exit
    stuck.set()
    server_thread.join(10)
    assert not server_thread.is_alive()


def test_a_background_server_serves_on_a_free_port_and_drains_on_terminate():
    import httpx

    app = create_app(EchoService())
    live = BackgroundServer(app, grace_s=0.2)
    try:
        assert live.host == "127.0.0.1" and live.port > 0
        assert live.base_url == f"http://127.0.0.1:{live.port}/v1"
        assert live.thread.daemon and live.thread.is_alive()
        assert httpx.get(live.base_url + "/models", timeout=10).json()["data"][0]["id"] == "echo"
        t0 = time.monotonic()
        live.terminate()
        live.thread.join(5)
        assert not live.thread.is_alive() and time.monotonic() - t0 < 0.2 + 2.0  # the grace and about a second
        assert app.state.shutdown.closing
    finally:
        live.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn exits its thread
def test_a_background_server_on_a_taken_port_fails_at_once():
    first = BackgroundServer(create_app(EchoService()))
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{first.port}"):
            BackgroundServer(create_app(EchoService()), port=first.port, timeout_s=60)
        assert time.monotonic() - t0 < 30, "waited for the start-up timeout although the server thread had died"
    finally:
        first.stop()
    assert not first.thread.is_alive()


def test_a_background_server_listens_only_on_its_host():
    import httpx

    live = BackgroundServer(create_app(EchoService()), host="127.0.0.2")
    try:
        assert live.base_url == f"http://127.0.0.2:{live.port}/v1"
        assert httpx.get(live.base_url + "/models", timeout=10).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{live.port}/v1/models", timeout=10)
    finally:
        live.stop()


def test_graceful_server_serves_on_the_sockets_it_is_given():
    import socket

    import httpx
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = GracefulServer(uvicorn.Config(create_app(EchoService()), host="127.0.0.1", port=1, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_terminate_works_for_an_app_without_drain_state():
    async def bare(scope, receive, send):  # a plain ASGI app: no `state.shutdown`
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    live = BackgroundServer(bare)
    live.terminate()
    live.thread.join(5)
    assert not live.thread.is_alive()
