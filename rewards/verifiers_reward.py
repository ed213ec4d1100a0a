"""A verifiers environment's rubric as a reward.

verifiers' convention: an environment is a module with `load_environment(**kwargs)` returning a
`verifiers.Environment` (dataset, parser, rubric). `load_vf_environment(ref, env_args)` loads one, by the
module name `verifiers.load_environment` takes (an installed environment package) or by a file path
(`examples/verifiers_envs/tiny_math.py`: the same function, imported from the file). Rows built from its
dataset (`vf:` data sources, `ebpo.infra.task_libraries`) carry the environment's own input in
`metadata["verifiers"]`, and `verifiers_reward` scores a completion with the environment's rubric:
`await env.rubric.score_rollout(state)` on the state the environment builds for that input, with the
completion as the assistant message, in the verifier sandbox (`rewards.verifier_sandbox`), never in this
process. Single-turn environments only on this path (a multi-turn one needs its
own rollout loop: the gateway, docs/rl.md "Task libraries"). Needs the `envs` extra.
"""
from __future__ import annotations

import importlib.util

from rewards import verifier_sandbox
from rewards._vf_scoring import load_vf_environment, score_with_rubric
from rewards.api import RewardResult, skip
from rewards.reasoning_gym_reward import row_metadata

# load_vf_environment and score_with_rubric run inside the verifier sandbox's server: they live in a module that
# imports no sandbox, and are named here for users
__all__ = ["load_vf_environment", "score_with_rubric", "verifiers_agent", "verifiers_reward"]

async def verifiers_reward(*, completion: str, metadata, sandbox: str = "auto", timeout_s: float = 10.0,
                           memory_mb: int = 1024, **_) -> RewardResult:
    """The rubric's reward of `completion` for a row built from a verifiers environment (metadata["verifiers"]:
    env, env_args, input; or one level down, as the RL loop passes it: `row_metadata`), scored in the verifier
    sandbox (`rewards.verifier_sandbox`: the environment is loaded there, and the rubric, third-party code
    fed policy text, runs in a confined child with no network; a rubric that calls a model cannot score).
    sandbox, timeout_s, memory_mb: the sandbox's mode, the rubric's deadline and its memory. Skips rows that
    are not from one or when verifiers is missing; an environment or rubric that raises or runs past its
    deadline scores 0.0 (extras["error"]). extras: the rubric's numeric metrics."""
    holder = row_metadata(metadata, "verifiers")
    vf_meta = holder["verifiers"] if holder is not None else None
    if not isinstance(vf_meta, dict) or "env" not in vf_meta or "input" not in vf_meta:
        return skip("not a verifiers row: metadata has no verifiers.env / verifiers.input")
    if importlib.util.find_spec("verifiers") is None:
        return skip("verifiers is not installed (pip install -e '.[envs]', Python 3.11-3.13)")
    env_input = vf_meta["input"] if isinstance(vf_meta["input"], dict) else {}
    gold = env_input.get("answer")
    out = verifier_sandbox.score("vf", {"input": env_input, "answer": completion or ""},
                                 gold=str(gold) if gold is not None else "", timeout_s=timeout_s,
                                 memory_mb=memory_mb, mode=sandbox,
                                 vf_env=(vf_meta["env"], vf_meta.get("env_args") or {}))
    if "skip" in out:
        return skip(out["skip"])
    if "error" in out:
        return RewardResult(0.0, {"error": out["error"]})
    return RewardResult(out["score"], out["metrics"])


async def verifiers_agent(client, row: dict, *, model: str | None = None, sampling_args: dict | None = None) -> dict:
    """Run the verifiers environment of `row` (built by a `vf:` source) with its own rollout loop against
    `client` (an `openai.AsyncOpenAI` pointed at any OpenAI-compatible endpoint: `ebpo serve`, the agent
    gateway), then score it with its rubric. Works for multi-turn environments too: the environment talks to
    the model itself. model: the model id (default: the endpoint's first); sampling_args: passed to the
    environment (`max_tokens`, `temperature`, ...). Returns {"reward", "metrics", "completion"}."""
    import verifiers

    vf_meta = row["metadata"]["verifiers"]
    env = load_vf_environment(vf_meta["env"], vf_meta.get("env_args"))
    if model is None:
        model = (await client.models.list()).data[0].id
    state = await env.rollout(dict(vf_meta["input"]), verifiers.OpenAIChatCompletionsClient(client), model,
                              dict(sampling_args or {}))
    await env.rubric.score_rollout(state)
    completion = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in state.get("completion") or []]
    return {"reward": float(state["reward"]), "metrics": dict(state.get("metrics") or {}),
            "completion": completion}  # plain data: the gateway hands the record to rewards as trajectory["agent"]
