"""Partial rollouts (ebpo.rl.partial_collect, the driver's side) through real Ray actors (tiny random model,
`trainer.partial_rollouts=true`): unfinished groups carry over to later steps with a weight version per block, the
lag bound holds, a frozen policy gives importance weights of exactly 1, and a run resumed from a checkpoint taken
with sequences in flight repeats the uninterrupted run."""
import pytest

ray = pytest.importorskip("ray")

from tests.support.async_runs import LEARNER, assert_same_steps, data, make_cfg, read_metrics, train  # noqa: E402,F401
from tests.support.ray_runs import ray_local  # noqa: E402,F401

PARTIAL = ("trainer.partial_rollouts=true", "rollout.prompts_per_step=3",
           "rollout.decode={max_new_tokens: 32, temperature: 1.0, max_batch: 6}")


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """The tiny random model with its EOS logit raised, so that sampled lengths vary (1 to 32 tokens, long-tailed): groups
    finish at different steps and some carry over."""
    import torch

    from ebpo.model.loading import load_model, load_model_tokenizer

    out = tmp_path_factory.mktemp("eos_model")
    model = load_model("preset:tiny@0")
    with torch.no_grad():  # EOS's logit up by about 3 along the mean final hidden state
        h = model.model(torch.randint(2, 100, (4, 32), generator=torch.Generator().manual_seed(0)))
        mu = h.reshape(-1, h.shape[-1]).mean(0)
        model.lm_head.weight[model.config.eos_token_id] += 3.0 * mu / mu.norm() ** 2
    model.save_pretrained(str(out))
    load_model_tokenizer("preset:tiny@0").save_pretrained(str(out))
    return str(out)


def cfg(data, run_dir, eos_model, *extra):
    return make_cfg(data, run_dir, f"model={eos_model}", *PARTIAL, *extra)


def test_partial_rollouts_carry_over_with_versions_per_block(ray_local, tmp_path, data, eos_model):
    run = train(cfg(data, tmp_path / "p", eos_model, "trainer.steps=4", "trainer.partial_overdue=drop", LEARNER))
    m = read_metrics(tmp_path / "p")
    assert sum(m[s]["partial/carried_token_share"] for s in range(1, 5)) > 0  # tokens decoded in earlier steps
    assert all(m[s]["train/samples"] == 9 for s in range(1, 5))  # the quota every step, whole groups
    for step, learner_version, versions in run.run.version_log:
        # the lag bound (max_staleness 0 + 1): oldest blocks at most one version behind, never ahead
        assert all(learner_version - 1 <= v <= learner_version for v in versions), (step, versions)
    assert any(v < lv for _, lv, vs in run.run.version_log for v in vs)  # some sample spans two versions
    # groups whose oldest block fell two versions behind were dropped and counted, never trained on
    assert m[4]["partial/dropped_total"] == sum(m[s]["partial/dropped"] for s in range(1, 5))
    assert m[4]["partial/lost_total"] == 0


def test_waiting_for_overdue_groups_trains_them_and_drops_nothing(ray_local, tmp_path, data, eos_model):
    # the default, trainer.partial_overdue=wait: a group the next step would drop is finished and trained now
    run = train(cfg(data, tmp_path / "w", eos_model, "trainer.steps=4", LEARNER))
    m = read_metrics(tmp_path / "w")
    assert m[4]["partial/dropped_total"] == 0
    assert all(m[s]["train/samples"] >= 9 and m[s]["train/samples"] % 3 == 0 for s in range(1, 5))  # quota + overdue
    assert any(m[s]["train/samples"] > 9 for s in range(1, 5))  # a group was overdue (the drop test drops one)
    for step, learner_version, versions in run.run.version_log:
        assert all(learner_version - 1 <= v <= learner_version for v in versions), (step, versions)
    # every group started is trained on or still in flight, once
    trained = sum(m[s]["train/samples"] for s in range(1, 5)) / 3
    assert m[4]["partial/groups_started"] == trained + m[4]["partial/in_flight_groups"]


def test_partial_rollouts_with_a_frozen_policy_weigh_exactly_one(ray_local, tmp_path, data, eos_model):
    train(cfg(data, tmp_path / "f", eos_model, "trainer.steps=3", "learner={n_draws: 2, mu: 1, lr: 0.0}"))
    m = read_metrics(tmp_path / "f")
    for s in range(1, 4):
        assert m[s]["actor/is_weight_min"] == 1.0 and m[s]["actor/is_weight_max"] == 1.0


def test_partial_rollouts_resume_exactly_with_sequences_in_flight(ray_local, tmp_path, data, eos_model):
    whole = tmp_path / "whole"
    train(cfg(data, whole, eos_model, "trainer.steps=4", LEARNER))
    part = tmp_path / "part"
    train(cfg(data, part, eos_model, "trainer.steps=4", "trainer.stop_after=2", LEARNER))
    assert read_metrics(part)[2]["partial/in_flight_groups"] > 0  # the checkpoint holds sequences in flight
    train(cfg(data, part, eos_model, "trainer.steps=4", f"trainer.resume={part}", LEARNER))
    assert_same_steps(read_metrics(whole), read_metrics(part), [3, 4])
    for step in (3, 4):
        assert read_metrics(part)[step]["partial/carried_token_share"] == read_metrics(whole)[step][
            "partial/carried_token_share"]


def test_partial_rollouts_in_the_asynchronous_loop_resume_exactly(ray_local, tmp_path, data, eos_model):
    """The checkpoint holds the steps collected ahead and the sequences carried by the rollout workers as of the
    last of them (the producer waits for the checkpoint before it starts another step)."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    extra = ("trainer.steps=4", "trainer.max_staleness=1", LEARNER)
    train(cfg(data, whole, eos_model, *extra))
    train(cfg(data, part, eos_model, *extra, "trainer.stop_after=2"))
    train(cfg(data, part, eos_model, *extra, f"trainer.resume={part}"))
    assert_same_steps(read_metrics(whole), read_metrics(part), [3, 4])


def test_partial_rollouts_in_the_asynchronous_loop(ray_local, tmp_path, data, eos_model):
    run = train(cfg(data, tmp_path / "a", eos_model, "trainer.steps=4", "trainer.max_staleness=1", LEARNER))
    m = read_metrics(tmp_path / "a")
    assert all(m[s]["train/samples"] >= 9 and m[s]["train/samples"] % 3 == 0 for s in range(1, 5))
    assert m[4]["partial/dropped_total"] == 0  # overdue groups are waited for (trainer.partial_overdue=wait)
    for step, learner_version, versions in run.run.version_log:
        assert all(learner_version - 2 <= v <= learner_version for v in versions), (step, versions)


def test_multi_turn_partial_rollouts_train_whole_episodes_within_the_lag_bound(ray_local, tmp_path):
    """The agent recipe with partial rollouts in the asynchronous loop, tools slow in half the episodes
    (ebpo.bench.slow_tools): episodes, some waiting on their tools at a step's end, carry over; whole groups are
    trained within the lag bound (2 versions), and every group started is trained or still in flight."""
    from ebpo.infra.config import load_config
    from ebpo.rl.config import RLConfig

    run_dir = tmp_path / "mt"
    run = train(load_config(RLConfig, "recipes/quickstart_agent.yaml", [
        "env.name=ebpo.bench.slow_tools:slow_calculator",
        "env.kwargs={max_turns: 3, timeout_s: 2.0, slow_s: 1.0, fast_s: 0.0, slow_share: 0.5}",
        "env.turns.max_workers=64", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.num_threads=1",
        "trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.steps=3", "trainer.dynamic_sampling=0",
        "trainer.filter_zero_std=false", "data.eval=null", f"trainer.run_dir={run_dir}", "trainer.tracking=none",
        "trainer.progress=false", "trainer.plots=false", "trainer.save_every=0", "reward.num_workers=1",
        "learner={n_draws: 1, mu: 1, lr: 0.0001}"]))
    m = read_metrics(run_dir)
    assert all(m[s]["train/samples"] >= 4 and m[s]["train/samples"] % 2 == 0 for s in range(1, 4))
    assert sum(m[s]["agent/tool_calls"] for s in range(1, 4)) > 0  # episodes used the (slow) tool
    assert m[3]["partial/dropped_total"] == 0 and m[3]["partial/lost_total"] == 0
    for step, learner_version, versions in run.run.version_log:
        assert all(learner_version - 2 <= v <= learner_version for v in versions), (step, versions)
    trained = sum(m[s]["train/samples"] for s in range(1, 4)) / 2
    assert m[3]["partial/groups_started"] == trained + m[3]["partial/in_flight_groups"]


@pytest.mark.slow
def test_a_dead_rollout_worker_loses_only_its_groups_in_flight_and_counts_them(ray_local, tmp_path, data, eos_model,
                                                                              monkeypatch):
    from ebpo.rl.actors import ResilientActor

    original, calls = ResilientActor.submit, {"n": 0}

    def submit(self, method, *args, **kwargs):
        ticket = original(self, method, *args, **kwargs)
        if self.name == "rollout-1" and method == "generate_partial":
            calls["n"] += 1
            if calls["n"] == 3:  # step 3: killed right after submit, with groups carried from steps 1-2
                ray.kill(self.handle, no_restart=True)
        return ticket

    monkeypatch.setattr(ResilientActor, "submit", submit)
    run = train(cfg(data, tmp_path / "k", eos_model, "trainer.steps=4", "rollout.num_workers=2",
                    "reward.num_actors=2", LEARNER))
    assert any("rollout-1 died during generate_partial" in e for e in run.events)
    m = read_metrics(tmp_path / "k")
    G = 3
    assert m[4]["partial/lost_total"] > 0 and m[4]["partial/lost_total"] % G == 0
    # every group started is trained on, dropped, lost or still in flight: counted once
    trained = sum(m[s]["train/prompts_drawn"] for s in range(1, 5))
    assert m[4]["partial/groups_started"] == (trained + m[4]["partial/dropped_total"] / G
                                              + m[4]["partial/lost_total"] / G + m[4]["partial/in_flight_groups"])


@pytest.mark.parametrize("extra,key", [
    (["trainer.partial_max_lag=0"], "trainer.partial_max_lag"),
    (["trainer.max_staleness=2", "trainer.partial_max_lag=1"], "trainer.partial_max_lag"),
    (["trainer.partial_extra_groups=-1"], "trainer.partial_extra_groups"),
    (["trainer.partial_overdue=keep"], "trainer.partial_overdue"),
    (["trainer.partial_rollouts=true", "trainer.dynamic_sampling=1", "trainer.filter_zero_std=true"],
     "trainer.dynamic_sampling"),
    (["trainer.partial_rollouts=true", "env.agent=examples/agents/calculator_agent.py:agent"], "env.agent"),
])
def test_partial_rollout_settings_are_checked_at_start_up(data, tmp_path, extra, key):
    from ebpo.infra.config import load_config  # noqa: F811
    from ebpo.rl.config import RLConfig  # noqa: F811

    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        load_config(RLConfig, None, ["model=preset:tiny@0", f"data.train={data}", "data.eval=null", *extra])


def test_the_learner_keeps_the_versions_a_carried_block_may_come_from(data):
    from ebpo.infra.config import load_config  # noqa: F811
    from ebpo.rl.config import RLConfig  # noqa: F811

    base = ["model=preset:tiny@0", f"data.train={data}", "data.eval=null", "trainer.partial_rollouts=true"]
    assert load_config(RLConfig, None, base).learner.max_staleness == 1
    assert load_config(RLConfig, None, base + ["trainer.max_staleness=1"]).learner.max_staleness == 2
    assert load_config(RLConfig, None, base + ["trainer.partial_max_lag=3"]).learner.max_staleness == 3
    assert load_config(RLConfig, None, base[:-1]).learner.max_staleness == 0
