"""The asynchronous RL loop (ebpo.rl.async_loop, ebpo.rl.async_pipeline) through real Ray actors (tiny random model):
the pipeline at s = 0 is the synchronous loop, the staleness bound holds on every recorded sample, a frozen policy
gives importance weights of 1, a resumed s = 1 run repeats the uninterrupted one, and a rollout worker killed
mid-flight loses nothing."""
import pytest

ray = pytest.importorskip("ray")

from tests.support.async_runs import LEARNER, assert_same_steps, data, make_cfg, read_metrics, train  # noqa: E402,F401
from tests.support.ray_runs import ray_local  # noqa: E402,F401  (an embedded instance, never a `ray start` cluster)

def test_pipeline_at_staleness_zero_is_the_synchronous_loop(ray_local, tmp_path, data):
    from ebpo.rl.async_loop import AsyncLoop

    train(make_cfg(data, tmp_path / "sync", "trainer.steps=3", LEARNER))
    # the asynchronous loop run at s = 0: the producer waits for every update
    forced = train(make_cfg(data, tmp_path / "pipe", "trainer.steps=3", LEARNER), loop=AsyncLoop)
    assert [v for _, _, v in forced.version_log] == [[0] * 6, [1] * 6, [2] * 6]  # every sample fresh
    assert_same_steps(read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "pipe"), [1, 2, 3])


def test_staleness_one_bounds_versions_and_a_frozen_policy_weighs_one(ray_local, tmp_path, data):
    s1 = train(make_cfg(data, tmp_path / "s1", "trainer.steps=4", "trainer.max_staleness=1", LEARNER))
    for step, learner_version, versions in s1.version_log:
        assert all(learner_version - 1 <= v <= learner_version for v in versions), (step, versions)
    # the fixed lag: step k samples with the weights after step k - 2 (version k - 2), one behind
    assert [(lv, sorted(set(v))) for _, lv, v in s1.version_log] == [(0, [0]), (1, [0]), (2, [1]), (3, [2])]
    m = read_metrics(tmp_path / "s1")
    assert [m[k]["async/staleness_max"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert m[3]["actor/is_weight_max"] != 1.0 or m[3]["actor/is_weight_min"] != 1.0  # a moving policy
    assert all("timing_s/wait_rollout" in m[k] and "timing_s/wait_learner" in m[k] for k in (1, 2, 3, 4))
    frozen_cfg = make_cfg(data, tmp_path / "frozen", "trainer.steps=4", "trainer.max_staleness=2",
                          "learner={n_draws: 2, mu: 1, lr: 0.0}")
    train(frozen_cfg)
    f = read_metrics(tmp_path / "frozen")
    assert f[4]["async/staleness_max"] == 2.0
    for k in (1, 2, 3, 4):
        assert f[k]["actor/is_weight_min"] == 1.0 and f[k]["actor/is_weight_max"] == 1.0, f[k]
        assert f[k]["actor/is_truncated_frac"] == 0.0


@pytest.mark.slow
def test_staleness_one_resumes_exactly(ray_local, tmp_path, data):
    full = tmp_path / "full"
    train(make_cfg(data, full, "trainer.steps=4", "trainer.max_staleness=1", LEARNER))
    staged = tmp_path / "staged"
    train(make_cfg(data, staged, "trainer.steps=4", "trainer.stop_after=2", "trainer.max_staleness=1", LEARNER))
    assert (staged / "checkpoints" / "step_2" / "in_flight.pt").exists()
    train(make_cfg(data, staged, "trainer.steps=4", f"trainer.resume={staged}", "trainer.max_staleness=1", LEARNER))
    assert_same_steps(read_metrics(full), read_metrics(staged), [3, 4])


@pytest.mark.slow
def test_rollout_worker_killed_mid_flight_redoes_its_work(ray_local, tmp_path, data, monkeypatch):
    from ebpo.rl.actors import ResilientActor

    extra = ("trainer.steps=4", "trainer.max_staleness=1", "rollout.num_workers=2", "reward.num_actors=2", LEARNER)
    train(make_cfg(data, tmp_path / "calm", *extra))
    original, calls = ResilientActor.submit, {"n": 0}

    def submit(self, method, *args, **kwargs):
        ticket = original(self, method, *args, **kwargs)
        if self.name == "rollout-1" and method == "generate":
            calls["n"] += 1
            if calls["n"] == 3:  # rollout-1's third generate call (step 3's rollouts): killed right after submit
                ray.kill(self.handle, no_restart=True)
        return ticket

    monkeypatch.setattr(ResilientActor, "submit", submit)
    killed = train(make_cfg(data, tmp_path / "killed", *extra))
    assert any("rollout-1 died during generate" in e for e in killed.events)
    m = read_metrics(tmp_path / "killed")
    assert m[4]["faults/restarts"] == 1.0
    assert [len(v) for _, _, v in killed.version_log] == [6, 6, 6, 6]  # no sample lost or counted twice
    assert_same_steps(read_metrics(tmp_path / "calm"), m, [1, 2, 3, 4])
