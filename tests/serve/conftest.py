"""An `ebpo serve` app on uvicorn in a thread, on a free port, for the tests that drive it with the real client."""
import socket
import threading
import time

import pytest


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread; `stop()` shuts it down."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served():
    """(ChatService, EngineDriver, LiveServer) of tiny-agent, quality preset, 48 new tokens by default."""
    pytest.importorskip("openai")
    import torch

    from ebpo.serve.app import create_app
    from ebpo.serve.cli import build_service

    torch.manual_seed(0)
    service, driver = build_service("tiny-agent", overrides={"max_new_tokens": 48}, max_batch=16, max_len=512)
    live = LiveServer(create_app(service))
    yield service, driver, live
    live.stop()
    driver.close()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[2].base_url, api_key="unused", max_retries=0, timeout=120)
