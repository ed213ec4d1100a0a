"""Multi-turn samples in the RL driver, without Ray: the learner batch scores exactly the model's tokens
(checked against a plain loop over the trajectory), refuses a layout that would leak the future, and the
rollout worker's multi-turn path returns records that hold together."""
import functools

import pytest
import torch

from ebpo.infra.config import ConfigError, build
from ebpo.rl.config import RLConfig
from ebpo.rl.records import RolloutSample, build_learner_batch

K = 4


def trajectory(prompt, turns):
    """A plain-data trajectory: `turns` = [(model ids, observation ids or None)], model ids block-aligned."""
    ids, gen, seg = list(prompt), [False] * len(prompt), [0] * len(prompt)
    for t, (model, obs) in enumerate(turns):
        ids += model
        gen += [True] * len(model)
        seg += [2 * t + 1] * len(model)
        if obs:
            ids += obs
            gen += [False] * len(obs)
            seg += [2 * t + 2] * len(obs)
    return {"prompt_ids": list(prompt), "ids": ids, "generated": gen, "segment": seg, "turns": []}


def sample_of(traj):
    return RolloutSample(token_ids=traj["ids"][len(traj["prompt_ids"]):], text="", num_forwards=1, tpf=1.0,
                         num_edits=0, finished_by_eos=True, trajectory=traj)


def test_learner_batch_scores_only_generated_tokens():
    # prompt of 6 (the first turn shares the prompt's last block), turn 1 ends on a block boundary, a
    # 3-token observation, turn 2 starts inside the observation's block (decoded with it visible)
    t = trajectory([1, 2, 3, 4, 5, 6], [([7, 8], [50, 51, 52]), ([9, 10, 11, 12, 13], None)])
    assert len(t["ids"]) == 16
    single_prompt, single_resp = [1, 2, 3], [20, 21, 2]
    s = sample_of(t)
    batch = build_learner_batch([s.prompt_ids, single_prompt], [s.token_ids, single_resp], torch.zeros(2),
                                torch.arange(2), pad_id=0, turns=[(t["generated"], t["segment"]), None], block_size=K)
    expected = torch.zeros(2, 16, dtype=torch.bool)
    for j, g in enumerate(t["generated"]):  # plain loop: the model's tokens, nothing else
        expected[0, j] = g
    for j in range(len(single_resp)):
        expected[1, len(single_prompt) + j] = True
    assert torch.equal(batch.response_mask, expected)
    assert batch.input_ids[0].tolist() == t["ids"]


def test_learner_batch_refuses_a_turn_sharing_its_block_with_the_future():
    # turn 1 ends at position 7, inside block 1, and the observation follows in the same block
    t = trajectory([1, 2, 3, 4, 5, 6], [([7], [50, 51]), ([9, 10, 11], None)])
    s = sample_of(t)
    with pytest.raises(ValueError, match="row 0 block 1"):
        build_learner_batch([s.prompt_ids], [s.token_ids], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                            pad_id=0, turns=[(t["generated"], t["segment"])], block_size=K)


def test_rollout_sample_checks_its_trajectory():
    t = trajectory([1, 2], [([7, 8], None)])
    with pytest.raises(ValueError, match="token_ids"):
        RolloutSample(token_ids=[7], text="", num_forwards=1, tpf=1.0, num_edits=0, finished_by_eos=True, trajectory=t)
    bad = dict(t, generated=t["generated"][:-1])
    with pytest.raises(ValueError, match="differ in length"):
        sample_of(bad)
    assert sample_of(t).prompt_ids == [1, 2]


@pytest.mark.parametrize("override", ["rollout.decode={mbe_window: 1}", "rollout.eval_decode={compiled_step: true}",
                                      "rollout.decode={tau_delete: 0.5, tau_insert: 0.5}", "learner.levenshtein=true"])
def test_decoding_features_and_l_ebpo_are_accepted_with_an_environment(override):
    """One rollout engine decodes single- and multi-turn alike, and L-EBPO scores multi-turn rows under the
    turn-aligned mask (tests/levenshtein/test_lev_multiturn.py): start-up refuses none of them with env.name."""
    from ebpo.infra.config import load_config

    cfg = load_config(RLConfig, None, ["env.name=calculator", override])
    assert cfg.env.multi_turn


def test_env_turns_are_typed_and_checked():
    cfg = build(RLConfig, {"env": {"name": "calculator", "turns": {"max_turns": 2}}})
    assert cfg.env.multi_turn and cfg.env.turns.max_turns == 2
    with pytest.raises(ConfigError, match="env.turns.max_turnz"):
        build(RLConfig, {"env": {"name": "calculator", "turns": {"max_turnz": 2}}})
    with pytest.raises(ConfigError, match="max_turns"):
        build(RLConfig, {"env": {"name": "calculator", "turns": {"max_turns": 0}}})
    assert not build(RLConfig, {}).env.multi_turn


def test_rollout_worker_multi_turn_records():
    """The worker's multi-turn path on the shipped tiny agent: every sample is a valid record whose
    learner row scores the model's tokens only, and the tool's answer is context."""
    from rewards.envs import make_environment
    from rollout.worker import RolloutWorker

    from ebpo.infra.data import encode_prompt

    worker = RolloutWorker("tiny-agent", {"preset": "quality"}, num_threads=1,
                           env_factory=functools.partial(make_environment, "calculator", {"max_turns": 3}),
                           multiturn={"max_turn_tokens": 96, "max_total_tokens": 320})
    rows = [{"prompt": "Compute 482*37.", "answer": "17834"}, {"prompt": "What is 482 times 37?", "answer": "17834"}]
    prompts = [encode_prompt(worker.tokenizer, r["prompt"]) for r in rows]
    outs = [RolloutSample.from_worker(o) for o in worker.generate(prompts, [1, 2], rows=rows)]
    K = worker.model.config.block_size
    called = [o for o in outs if o.trajectory["turns"][0]["tool_calls"]]
    assert called, "tiny-agent calls the calculator on 'Compute ...'"
    for o, p in zip(outs, prompts):
        t = o.trajectory
        assert o.prompt_ids == p and len(t["ids"]) % K == 0
        assert o.text == t["turns"][-1]["text"]
        batch = build_learner_batch([o.prompt_ids], [o.token_ids], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                                    pad_id=0, turns=[(t["generated"], t["segment"])], block_size=K)
        scored = [tok for tok, m in zip(batch.input_ids[0].tolist(), batch.response_mask[0].tolist()) if m]
        model_tokens = [tok for tok, g in zip(t["ids"], t["generated"]) if g]
        assert scored == model_tokens
    obs = called[0].trajectory["turns"][0]
    text = worker.tokenizer.decode(called[0].trajectory["ids"][obs["obs_start"]:obs["obs_end"]])
    assert "17834" in text and not any(called[0].trajectory["generated"][obs["obs_start"]:obs["obs_end"]])
