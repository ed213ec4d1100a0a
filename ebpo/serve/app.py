"""The OpenAI-compatible ASGI app (FastAPI): GET /v1/models, POST /v1/chat/completions.

`create_app(service)` serves a `ChatService` (`ebpo serve`); `create_app(..., complete=...)` mounts the same
routes under another path (the agent gateway serves one client per episode under `/episodes/{episode}/v1`).
Every error is answered in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx
status for the caller's mistakes (bad JSON, bad fields, unknown model or route) and 500 for a server fault;
no request can stop the server.

What a client can make the server do is bounded before any work starts (docs/serving.md, "Limits"):

* an API key (`api_key`), when set, is required on every route (`Authorization: Bearer KEY`, compared in
  constant time; 401 otherwise);
* a POST must be `Content-Type: application/json` (charset utf-8 or none; 415 otherwise): a browser can send
  a `text/plain` POST to a local server from any web page without a cross-origin pre-check, never a JSON one;
* the body is read up to `max_body_bytes` (413 otherwise): a larger declared `Content-Length` is refused
  before a byte is read, a chunked body is cut at the limit;
* decoding and checking the JSON (`schema.decode_body`) runs in a worker thread, as does all tokenising
  (`ChatService`), so a large request never holds the event loop that answers the other clients.

`stream: true` is answered with server-sent events (`ChatService.stream`, `SSEResponse`); every check that can
refuse a request runs before the first byte, so a refusal is still a 4xx in the OpenAI shape. A request that
would take the server beyond its bound on sequences held at once gets 429 (`rate_limit_exceeded`, with
`Retry-After`).

A request whose client disconnects is cancelled: `ChatService.complete` aborts its sequences at the next
forward. `Shutdown` drains the server on SIGTERM (`GracefulServer`): new requests get 503, requests in flight
have the grace period to finish, then get a 503 and their sequences are aborted.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .schema import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE_S, RequestError, decode_body, parse_request

log = logging.getLogger("ebpo.serve")


def _error(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status,
                        headers=headers)


def check_api_key(request: Request, api_key: str | None) -> None:
    """RequestError (401) unless the request carries `Authorization: Bearer <api_key>` (no check when api_key
    is None). Constant-time comparison: the time taken says nothing about how much of a guess was right."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())):
        raise RequestError("missing or incorrect API key: send the header `Authorization: Bearer <key>`", None,
                           "invalid_api_key", status=401)


def check_json_content_type(request: Request) -> None:
    """RequestError (415) unless the Content-Type is application/json, with no charset or utf-8."""
    media, *params = [p.strip() for p in request.headers.get("content-type", "").split(";")]
    charsets = [v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params)
                if k.strip().lower() == "charset"]
    if media.lower() != "application/json" or any(c not in ("utf-8", "utf8") for c in charsets):
        raise RequestError(f"Content-Type must be application/json (utf-8), got {media or 'none'!r}", None,
                           "unsupported_media_type", status=415)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes: RequestError (413) for a larger declared Content-Length, before
    reading anything, or as soon as the bytes read pass the limit (a chunked body)."""
    declared = request.headers.get("content-length")
    too_big = RequestError(f"the request body is larger than this server's limit of {limit} bytes", None,
                           "request_too_large", status=413)
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(f"bad Content-Length {declared[:40]!r}", None, "invalid_request")
        if int(declared) > limit:
            raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise RequestError("the client went away while sending the body", None, "client_closed") from None
    return b"".join(chunks)


async def read_json(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES):
    """The request's JSON body (at most `limit` bytes), decoded and checked in a worker thread
    (`schema.decode_body`); RequestError when it is too large, not JSON, too deep or not valid text."""
    raw = await read_body(request, limit)
    return await asyncio.to_thread(decode_body, raw)


class Shutdown:
    """The drain state of a server. `begin(grace_s)` (on the event loop; `GracefulServer` calls it on SIGTERM):
    from then on `closing` is true and new requests get 503; after grace_s, `expired()` is set and every request
    still in flight is answered 503 and cancelled (its sequences aborted)."""

    def __init__(self):
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expired: asyncio.Event | None = None

    def expired(self) -> asyncio.Event:
        """The event of the running loop (an app may be served by one loop after another: the agent gateway
        runs each batch in a fresh one)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._expired = loop, asyncio.Event()
        return self._expired

    def begin(self, grace_s: float) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_later(max(0.0, grace_s), self.expired().set)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the ASGI server's `http.disconnect`); the body must be read already."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def supervise(request: Request, work: asyncio.Future, shutdown: Shutdown | None):
    """`work`'s result; `work` is cancelled when the client disconnects first (answered 499, which nobody
    reads) or when the shutdown grace ends first (503)."""
    gone = asyncio.ensure_future(_disconnected(request))
    watchers = {gone}
    if shutdown is not None:
        watchers.add(asyncio.ensure_future(shutdown.expired().wait()))
    try:
        await asyncio.wait(watchers | {work}, return_when=asyncio.FIRST_COMPLETED)
        client_gone = gone.done()
    finally:
        for t in watchers:
            t.cancel()
        if not work.done():
            work.cancel()  # its cleanup (aborting sequences) runs synchronously in the cancelled coroutine
    if work.done() and not work.cancelled():
        return work.result()
    await asyncio.gather(work, return_exceptions=True)
    if client_gone:
        return _error(499, "the client closed the request", "invalid_request_error", code="client_closed")
    raise RequestError("the server is shutting down: the request did not finish within the shutdown grace",
                       None, "server_shutting_down", status=503, type="server_error")


def create_app(service, complete=None, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app over `service` (a `ChatService`: `name`, `default`, `max_tokens_limit`, `complete(request)`).

    complete: `async (request, ChatRequest) -> dict` instead of `service.complete` (the agent gateway passes
    one that reads the episode from the path); the routes then also exist under `/episodes/{episode}/v1`.
    api_key: required as `Authorization: Bearer KEY` on every route when set; max_body_bytes: the largest
    request body read (module docstring). `app.state.shutdown` is the app's `Shutdown`."""
    app = FastAPI(title="ebpo serve", docs_url=None, redoc_url=None, openapi_url=None)
    shutdown = app.state.shutdown = Shutdown()

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        # an unread body (413) is not drained: the connection is closed instead
        headers = dict(exc.headers or {})
        if exc.status == 413:
            headers["Connection"] = "close"
        return JSONResponse(exc.body(), exc.status, headers=headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        log.exception("ebpo serve: request failed")
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", "server_error")

    async def models(request: Request):
        check_api_key(request, api_key)
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ebpo"}]}

    async def chat(request: Request):
        check_api_key(request, api_key)
        check_json_content_type(request)
        if shutdown.closing:
            raise RequestError("the server is shutting down", None, "server_shutting_down", status=503,
                               type="server_error")
        body = await read_json(request, max_body_bytes)
        req = parse_request(body, service.default, service.max_tokens_limit)
        if req.stream:
            if complete is not None or not hasattr(service, "stream"):
                raise RequestError("stream=true is not supported here", "stream", "unsupported_parameter")
            work = asyncio.ensure_future(service.stream(req, shutdown.expired()))
            chat_stream = await supervise(request, work, shutdown)
            return chat_stream if isinstance(chat_stream, JSONResponse) else SSEResponse(chat_stream)
        work = asyncio.ensure_future(complete(request, req) if complete is not None else service.complete(req))
        return await supervise(request, work, shutdown)

    prefixes = ["/v1"] + (["/episodes/{episode}/v1"] if complete is not None else [])
    for prefix in prefixes:
        app.add_api_route(prefix + "/models", models, methods=["GET"])
        app.add_api_route(prefix + "/chat/completions", chat, methods=["POST"])
    return app


class SSEResponse(StreamingResponse):
    """The server-sent events of a `ChatStream`; the stream is closed (its unfinished sequences aborted, its
    sequences released) however the response ends: finished, the client gone, or the server stopping."""

    def __init__(self, chat_stream):
        super().__init__(chat_stream, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.chat_stream = chat_stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.chat_stream.close()


class GracefulServer(uvicorn.Server):
    """uvicorn that drains on SIGTERM / SIGINT: the app's `Shutdown` begins (503 for new requests; those in
    flight get `grace_s` to finish, then a 503), uvicorn stops accepting connections, and the process exits
    once every request is answered, within grace_s plus about a second. A second SIGINT forces the exit."""

    def __init__(self, config: uvicorn.Config, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S):
        config.timeout_graceful_shutdown = grace_s + 2.0  # uvicorn's own backstop, after ours
        super().__init__(config)
        self.grace_s = float(grace_s)
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """The signal handler (main thread); also callable from another thread to drain a server in one."""
        super().handle_exit(sig, frame)
        shutdown = getattr(getattr(self.config.app, "state", None), "shutdown", None)
        if shutdown is not None and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(shutdown.begin, self.grace_s)


class BackgroundServer:
    """uvicorn serving `app` on `host`:`port` (0 = a free port) in a daemon thread, started on construction;
    `base_url` is its `/v1` address, `stop()` shuts it down, `terminate()` drains it as SIGTERM does (the tests
    and `ebpo bench serve` use it). grace_s: the shutdown grace (`GracefulServer`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 grace_s: float = DEFAULT_SHUTDOWN_GRACE_S):
        import socket
        import threading

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="warning"), grace_s)
        self.thread = threading.Thread(target=self.server.run, name="ebpo-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {host}:{port}")
            time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def terminate(self) -> None:
        """Drain as on SIGTERM (`GracefulServer.handle_exit`); `thread` ends when the server has exited."""
        import signal

        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
