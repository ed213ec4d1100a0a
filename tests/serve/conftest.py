"""An `ebpo serve` app on uvicorn in a thread, on a free port, for the tests that drive it with the real client."""
import pytest


@pytest.fixture(scope="module")
def served():
    """(ChatService, EngineDriver, BackgroundServer) of tiny-agent, quality preset, 48 new tokens by default."""
    pytest.importorskip("openai")
    import torch

    from ebpo.serve.app import BackgroundServer, create_app
    from ebpo.serve.cli import build_service

    torch.manual_seed(0)
    service, driver = build_service("tiny-agent", overrides={"max_new_tokens": 48}, max_batch=16, max_len=512)
    live = BackgroundServer(create_app(service))
    yield service, driver, live
    live.stop()
    driver.close()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[2].base_url, api_key="unused", max_retries=0, timeout=120)
