"""The OpenAI-compatible ASGI app (FastAPI): GET /v1/models, POST /v1/chat/completions.

`create_app(service)` serves a `ChatService` (`ebpo serve`); `create_app(..., prefix=...)` mounts the same
routes under another path (the agent gateway serves one client per episode under `/episodes/{episode}/v1`).
Every error is answered in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx
status for the caller's mistakes (bad JSON, bad fields, unknown model or route) and 500 for a server fault;
no request can stop the server.
"""
from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schema import RequestError, parse_request

log = logging.getLogger("ebpo.serve")


def _error(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


async def read_json(request: Request):
    """The request's JSON body; RequestError when it is not JSON."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


def create_app(service, complete=None) -> FastAPI:
    """The app over `service` (a `ChatService`: `name`, `default`, `max_tokens_limit`, `complete(request)`).

    complete: `async (request, ChatRequest) -> dict` instead of `service.complete` (the agent gateway passes
    one that reads the episode from the path); the routes then also exist under `/episodes/{episode}/v1`."""
    app = FastAPI(title="ebpo serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        log.exception("ebpo serve: request failed")
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", "server_error")

    async def models(request: Request):
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ebpo"}]}

    async def chat(request: Request):
        body = await read_json(request)
        req = parse_request(body, service.default, service.max_tokens_limit)
        if complete is not None:
            return await complete(request, req)
        return await service.complete(req)

    prefixes = ["/v1"] + (["/episodes/{episode}/v1"] if complete is not None else [])
    for prefix in prefixes:
        app.add_api_route(prefix + "/models", models, methods=["GET"])
        app.add_api_route(prefix + "/chat/completions", chat, methods=["POST"])
    return app


class BackgroundServer:
    """uvicorn serving `app` on `host`:`port` (0 = a free port) in a daemon thread, started on construction;
    `base_url` is its `/v1` address, `stop()` shuts it down (the tests and `ebpo bench serve` use it)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0):
        import socket
        import threading

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
