"""Loading a verifiers environment and scoring a completion with its rubric: what the verifier sandbox's server
runs (rewards._verifier_server), in a module of its own so that the server imports no reward or sandbox module.
Users reach these through `rewards.verifiers_reward`."""
from __future__ import annotations

import json

from rewards.loader import load_module_file

_ENVS: dict = {}  # (ref, env_args as JSON) -> environment, one per process
_UNUSED_URL = "http://127.0.0.1:9/v1"  # scoring never calls the model: the state only needs a client object


def load_vf_environment(ref: str, env_args: dict | None = None):
    """The verifiers environment `ref` built with `env_args` (cached per process): a file path ending in .py
    (its `load_environment`), else `verifiers.load_environment(ref, **env_args)`."""
    key = (ref, json.dumps(env_args or {}, sort_keys=True))
    if key not in _ENVS:
        if ref.endswith(".py"):
            module = load_module_file(ref, ref)
            if not callable(getattr(module, "load_environment", None)):
                raise ValueError(f"verifiers environment {ref!r} defines no load_environment()")
            _ENVS[key] = module.load_environment(**(env_args or {}))
        else:
            import verifiers

            _ENVS[key] = verifiers.load_environment(ref, **(env_args or {}))
    return _ENVS[key]


async def score_with_rubric(env, env_input: dict, completion) -> tuple[float, dict]:
    """(reward, metrics) of `completion` (text, or a list of chat messages) for one input of `env`'s dataset
    (its row without `question`), by the environment's rubric."""
    import verifiers
    from openai import AsyncOpenAI

    client = verifiers.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=_UNUSED_URL, api_key="unused"))
    state = await env.init_state(dict(env_input), client=client, model="ebpo", sampling_args=None)
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    state["completion"] = completion
    await env.rubric.score_rollout(state)
    return float(state["reward"]), dict(state.get("metrics") or {})
