"""A verifiers environment's own rollout loop against `ebpo serve`, through the real `openai` and `verifiers`
packages: the completions are what our decoder writes for the same prompts, and the reward is the
environment's rubric (checked against a plain boxed-answer comparison)."""
import asyncio
import re
import socket
import threading
import time
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers", reason="the envs extra (pip install -e '.[envs]'; Python 3.11-3.13)")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def endpoint():
    import uvicorn

    from ebpo.serve.app import create_app
    from ebpo.serve.cli import build_service

    service, driver = build_service("tiny-sft", overrides={"max_new_tokens": 40}, max_batch=8, max_len=512)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)
    driver.close()


def test_a_verifiers_environment_runs_against_ebpo_serve(endpoint, monkeypatch):
    from openai import AsyncOpenAI

    from ebpo.infra.data import encode_prompt, load_rows
    from ebpo.model.loading import load_model, load_model_tokenizer
    from rewards.verifiers_reward import verifiers_agent
    from rollout.config import DecodeConfig
    from rollout.decoder import generate

    monkeypatch.chdir(ROOT)
    rows = load_rows("vf:examples/verifiers_envs/tiny_math.py?limit=8")

    async def run_all():
        client = AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*[verifiers_agent(client, r, sampling_args={"max_tokens": 40, "temperature": 0.0})
                                      for r in rows])

    outs = asyncio.run(run_all())
    model, tok = load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")
    ref = generate(model, [encode_prompt(tok, r["prompt"]) for r in rows],
                   DecodeConfig.preset("quality", max_new_tokens=40), tokenizer=tok)
    for row, out, want in zip(rows, outs, ref):
        text = out["completion"][-1]["content"]  # plain dicts
        assert text == want.text  # the environment saw what our decoder writes for that prompt
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        assert out["reward"] == float(bool(boxed) and boxed[-1].strip() == row["answer"])
    rewards = [o["reward"] for o in outs]
    assert 0 < sum(rewards) < len(rewards)  # tiny-sft gets some of these right and some wrong: both verdicts seen


def test_a_verifiers_environment_runs_through_the_agent_gateway(monkeypatch):
    """`verifiers_agent` as an agent function: the environment's own loop through the in-process gateway (the
    real openai client); the gateway's trajectory holds exactly the turn the environment saw, and the episode's
    reward is the rubric's."""
    import functools

    from ebpo.infra.data import encode_prompt, load_rows
    from ebpo.model.loading import load_model, load_model_tokenizer
    from ebpo.serve.gateway import AgentGateway
    from rewards.verifiers_reward import verifiers_agent
    from rollout.config import DecodeConfig
    from rollout.decoder import generate
    from rollout.multiturn import MultiTurnConfig

    monkeypatch.chdir(ROOT)
    rows = load_rows("vf:examples/verifiers_envs/tiny_math.py?limit=8")
    model, tok = load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")
    gateway = AgentGateway(model, tok, DecodeConfig.preset("quality"), MultiTurnConfig(max_turns=1, max_turn_tokens=40,
                                                                                       max_total_tokens=256))
    try:
        samples = gateway.run(functools.partial(verifiers_agent, model="policy"), rows)
    finally:
        gateway.close()
    ref = generate(model, [encode_prompt(tok, r["prompt"]) for r in rows],
                   DecodeConfig.preset("quality", max_new_tokens=40), tokenizer=tok)
    for row, sample, want in zip(rows, samples, ref):
        traj = sample["trajectory"]
        assert not traj["failed"], traj["error"]
        text = traj["agent"]["completion"][-1]["content"]
        assert text == sample["text"] == want.text  # the turn the environment scored is the one the gateway recorded
        assert traj["ids"][:len(traj["prompt_ids"])] == encode_prompt(tok, row["prompt"])
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        assert traj["env_reward"] == traj["agent"]["reward"] == float(bool(boxed) and boxed[-1].strip() == row["answer"])
    rewards = [s["trajectory"]["env_reward"] for s in samples]
    assert 0 < sum(rewards) < len(rewards)  # both verdicts seen
