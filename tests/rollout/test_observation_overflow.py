"""A tool result too long for what is left of `max_total_tokens` ends the trajectory with its own named,
counted stop reason, `observation_overflow`: with the agent quickstart's limits, a tool
result at `Tool.max_chars`' default (2,000 characters) cannot fit."""
import pytest

from ebpo.infra.data import encode_prompt
from ebpo.model.loading import load_model, load_model_tokenizer
from rewards.envs import Tool, ToolEnv
from rollout.config import DecodeConfig
from rollout.multiturn import MultiTurnConfig, generate_multiturn
from rollout.trajectory import summarize, trajectory_text

QUICKSTART_TURNS = {"max_turns": 3, "max_turn_tokens": 96, "max_total_tokens": 320}  # recipes/quickstart_agent.yaml


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")


def make_tool_env(chars: int) -> ToolEnv:
    def dump() -> str:
        """A tool whose result is long."""
        return "7" * chars

    return ToolEnv([Tool(dump, timeout_s=2.0)], max_turns=3)


class CallsTheTool:
    """Whatever the model writes, the turn is a call of `dump` in the real ToolEnv: the observation is the
    tool's real result, cut by the real `Tool.max_chars`."""

    def __init__(self, chars: int):
        self.env = make_tool_env(chars)

    def reset(self, row, seed=None):
        return self.env.reset(row, seed)

    def step(self, text):
        return self.env.step('<tool_call>{"name": "dump", "arguments": {}}</tool_call>')


def test_the_default_tool_result_limit_is_2000_characters():
    env = make_tool_env(5000)
    env.reset({"prompt": "x"})
    obs = env.step('<tool_call>{"name": "dump", "arguments": {}}</tool_call>').observation
    assert Tool(len).max_chars == 2000 and obs == "7" * 2000


def test_an_observation_that_does_not_fit_is_a_named_counted_stop(tiny):
    model, tok = tiny
    prompts = [encode_prompt(tok, "Compute 12+7."), encode_prompt(tok, "Compute 45-3.")]
    envs = [CallsTheTool(5000), CallsTheTool(20)]
    for env in envs:
        env.reset({"prompt": "x"})
    trajs = generate_multiturn(model, prompts, envs, DecodeConfig.preset("quality", mbe_window=0),
                               MultiTurnConfig(**QUICKSTART_TURNS), tokenizer=tok)
    long, short = trajs
    assert long.stop == "observation_overflow" and not long.failed
    assert len(long.turns) == 1 and long.turns[0].observation == "7" * 2000  # recorded, not appended
    assert "does not fit" in long.error and "max_total_tokens 320" in long.error
    assert len(long.ids) <= QUICKSTART_TURNS["max_total_tokens"] and not any(long.segment[i] == 2 for i in
                                                                               range(len(long.ids)))
    assert short.stop == "done" and len(short.turns) == 3  # a short result fits: the episode goes on to its end
    m = summarize(trajs)
    assert m["agent/stop/observation_overflow"] == 1 and m["agent/observation_overflow"] == pytest.approx(0.5)
    assert "agent/stop/max_total_tokens" not in m
    assert "[stop: observation_overflow" in trajectory_text(long.to_dict())
