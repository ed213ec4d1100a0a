"""Agent functions in RL: loading one from a recipe's `env.agent`, and the rollout worker that runs them.

    env:
      agent: examples/agents/calculator_agent.py:calculator_agent   # or package.module:function
      kwargs: {max_turns: 3}                                         # keyword arguments of the agent function
      turns: {max_turns: 3, max_turn_tokens: 96, max_total_tokens: 320, step_timeout_s: 30}

`AgentRolloutWorker` is a `rollout.worker.RolloutWorker` whose multi-turn rollouts run the agent function,
one episode per dataset row, through an in-process `ebpo.serve.gateway.AgentGateway` on the worker's own
policy copy (weights synced as for any rollout worker). Its samples have the shape of the native
environment path's, so rewards, advantages and the learner treat both alike.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from rollout.worker import RolloutWorker


class AgentLoadError(ValueError):
    """An agent reference that cannot be imported, or that is not an async function."""


def load_agent(ref: str, kwargs: dict | None = None) -> Callable:
    """The async agent function named by `ref` ('package.module:function' or 'path/to/file.py:function'),
    with `kwargs` bound; AgentLoadError naming the reference and the reason."""
    from rewards.loader import RewardLoadError, import_reference

    if not isinstance(ref, str) or ":" not in ref:
        raise AgentLoadError(f"env.agent: expected 'package.module:function' or 'path/to/file.py:function', got {ref!r}")
    where, name = ref.rsplit(":", 1)
    try:
        module = import_reference(where, ref)
    except RewardLoadError as e:
        raise AgentLoadError(str(e).replace("reward", "agent", 1)) from e
    fn = getattr(module, name, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise AgentLoadError(f"env.agent {ref!r}: {where!r} has no async function {name!r} "
                             "(an agent is `async def agent(client, row) -> reward or record`)")
    if kwargs:
        try:
            inspect.signature(fn).bind(None, None, **kwargs)
        except TypeError as e:
            raise AgentLoadError(f"env.agent {ref!r}: env.kwargs {kwargs} do not fit its signature: {e}") from None
        fn = functools.partial(fn, **kwargs)
    return fn


class AgentRolloutWorker(RolloutWorker):
    """A rollout worker whose multi-turn rollouts are episodes of an agent function (module docstring).

    agent: the `env.agent` reference; agent_kwargs: `env.kwargs`; multiturn: `MultiTurnConfig` fields (the
    episode limits); the other arguments are `RolloutWorker`'s."""

    def __init__(self, model: str, decode: dict, *, agent: str, agent_kwargs: dict | None = None,
                 multiturn: dict | None = None, **kwargs):
        super().__init__(model, decode, multiturn=multiturn, **kwargs)
        self.agent = load_agent(agent, agent_kwargs)

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], decode: dict | None = None,
                 rows: list[dict] | None = None) -> list[dict]:
        """Rows given: one agent episode per row (prompt_ids are not used: the agent's first request is the
        prompt, rendered by the gateway; each sample carries its own `trajectory["prompt_ids"]`). Without rows:
        single-turn decoding, as `RolloutWorker.generate`."""
        if rows is None:
            return super().generate(prompt_ids, seeds, decode)
        if len(rows) != len(seeds):
            raise ValueError(f"AgentRolloutWorker.generate: one seed per row ({len(rows)}), got {len(seeds)}")
        from rollout import DecodeConfig
        from rollout.multiturn import MultiTurnConfig

        from .gateway import AgentGateway

        config = self.decode_config
        if decode is not None:
            decode = dict(decode)
            config = DecodeConfig.preset(decode.pop("preset", "quality"), **decode)
        gateway = AgentGateway(self.model, self.tokenizer, config, MultiTurnConfig(**self.multiturn),
                               max_batch=config.max_batch)
        try:
            samples = gateway.run(self.agent, rows, seeds if config.temperature > 0 else None)
        finally:
            gateway.close()
        for p, s in zip(prompt_ids, samples):
            s["weights_version"] = self.version
            t = s["trajectory"]
            if not t["ids"]:  # the agent failed before its first request: the row's prompt, nothing generated
                t.update(prompt_ids=list(p), ids=list(p), generated=[False] * len(p), segment=[0] * len(p))
        return samples
