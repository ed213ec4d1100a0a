"""The decoding-cost reward reads the rollout trace the RL trainer puts into the sample's metadata."""

from rewards import load_reward


def test_decode_cost_is_minus_forwards_per_token_and_skips_without_trace():
    fn = load_reward("decode_cost")
    r = fn(completion="x", metadata={"decode": {"forwards": 6, "tokens": 24}})
    assert r.score == -0.25 and r.extras["forwards"] == 6.0
    assert fn(completion="x", metadata={"task": "math"}).score is None  # skip: no trace
    assert fn(completion="x", metadata=None).score is None


def test_trainer_reward_sample_carries_the_decode_trace():
    from ebpo.rl.prompts import reward_input
    from ebpo.rl.records import RolloutSample

    row = {"prompt": "Compute 1+2.", "answer": "3", "task": "math", "response": "1+2=3 \\boxed{3}"}
    out = RolloutSample(token_ids=[1] * 20, text="\\boxed{3}", num_forwards=5, tpf=4.0, num_edits=0,
                        finished_by_eos=True)
    s = reward_input(row, "\\boxed{3}", "prompt", out)
    assert s["metadata"] == {"task": "math", "decode": {"forwards": 5, "tokens": 20}}
    assert load_reward("decode_cost")(**s).score == -0.25
    assert "decode" not in reward_input(row, "", "prompt")["metadata"]
