"""Multi-turn rollouts: every turn is what the single-turn decoder gives on the context so far; observations
are tokenised alone and start a new block; a failing, hanging or garbage-returning environment fails only
its own trajectory."""
import time

import pytest
import torch

from ebpo.core.turns import OBSERVATION_TEMPLATE, leaking_blocks
from ebpo.infra.data import encode_prompt
from ebpo.model.loading import load_model, load_model_tokenizer
from rollout.config import DecodeConfig
from rollout.decoder import generate
from rollout.multiturn import MultiTurnConfig, generate_multiturn
from rollout.trajectory import summarize

QUESTIONS = ["Compute 12+7.", "Compute 45-3.", "Write f(x): add 2 to x."]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")


class Scripted:
    """Answers every turn with `obs<k>`; done after `n` turns. `mode` breaks it: raise | hang | garbage."""

    def __init__(self, n, mode=None, latency=0.0):
        self.n, self.mode, self.latency, self.k = n, mode, latency, 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        time.sleep(self.latency)
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "garbage":
            return 42
        return (f"obs{self.k}", 0.25, self.k >= self.n, {"tool_calls": [{"name": "t", "ok": True, "latency_s": 0.0}]})


def run(tiny, envs, **mt):
    model, tok = tiny
    prompts = [encode_prompt(tok, q) for q in QUESTIONS[:len(envs)]]
    cfg = DecodeConfig.preset("quality", mbe_window=0)
    return prompts, generate_multiturn(model, prompts, envs, cfg, MultiTurnConfig(max_turn_tokens=24, **mt),
                                       tokenizer=tok)


def test_each_turn_is_the_single_turn_decode_of_its_context(tiny):
    model, tok = tiny
    prompts, trajs = run(tiny, [Scripted(1), Scripted(2), Scripted(3)], stop_at_tool_call=False)
    cfg = DecodeConfig.preset("quality", mbe_window=0, max_new_tokens=24)
    K = model.config.block_size
    for p, tr in zip(prompts, trajs):
        assert tr.ids[:len(p)] == p and tr.stop == "done" and not tr.failed
        for turn in tr.turns:
            ref = generate(model, [tr.ids[:turn.start]], cfg)[0]
            assert tr.ids[turn.start:turn.end] == ref.token_ids + ref.tail_ids
            assert turn.end % K == 0 and all(tr.generated[turn.start:turn.end])
            if turn.observation is not None:  # the observation: its own tokens, context, at a block boundary
                obs = tok(OBSERVATION_TEMPLATE.format(observation=turn.observation), add_special_tokens=False)["input_ids"]
                assert turn.obs_start == turn.end and tr.ids[turn.obs_start:turn.obs_end] == obs
                assert not any(tr.generated[turn.obs_start:turn.obs_end])
        assert not any(tr.generated[:len(p)])
        gen, seg = torch.tensor([tr.generated]), torch.tensor([tr.segment])
        assert not leaking_blocks(gen, seg, K).any()
    assert [len(t.turns) for t in trajs] == [1, 2, 3]
    assert trajs[2].env_reward == pytest.approx(0.75)


def test_waiting_sequences_do_not_change_anything_but_time(tiny):
    _, a = run(tiny, [Scripted(2, latency=0.2), Scripted(3), Scripted(1)], continue_ready=True)
    _, b = run(tiny, [Scripted(2, latency=0.2), Scripted(3), Scripted(1)], continue_ready=False)
    assert [t.ids for t in a] == [t.ids for t in b]
    assert [t.generated for t in a] == [t.generated for t in b]


@pytest.mark.parametrize("mode,stop", [("raise", "env_error"), ("hang", "env_timeout"), ("garbage", "env_error")])
def test_a_broken_environment_fails_only_its_trajectory(tiny, mode, stop):
    t0 = time.monotonic()
    _, trajs = run(tiny, [Scripted(2), Scripted(2, mode=mode), Scripted(3)], step_timeout_s=1.0)
    assert time.monotonic() - t0 < 25, "a hung environment must not hold the batch"
    assert trajs[1].failed and trajs[1].stop == stop and trajs[1].turns[-1].error
    assert not trajs[0].failed and not trajs[2].failed and len(trajs[2].turns) == 3
    m = summarize(trajs)
    assert m["agent/failed_count"] == 1 and m[f"agent/stop/{stop}"] == 1


def test_limits_end_trajectories(tiny):
    _, trajs = run(tiny, [Scripted(10), Scripted(10)], max_turns=2)
    assert all(t.stop == "max_turns" and len(t.turns) == 2 for t in trajs)
    _, trajs = run(tiny, [Scripted(10)], max_total_tokens=90)
    assert trajs[0].stop == "max_total_tokens" and len(trajs[0].ids) <= 96
