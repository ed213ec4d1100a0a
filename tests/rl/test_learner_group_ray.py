"""The learner group inside the RL driver: learner.num_workers=2 Ray actors form a gloo group through Ray,
train like one learner (same metrics at every step), checkpoint and resume."""
import contextlib

import pytest

from test_trainer import data, make_cfg, ray, ray_local, read_metrics, train  # noqa: E402,F401

COMPARED = ("reward/", "actor/", "response_length/", "decode/", "likelihood/")


@contextlib.contextmanager
def rank_1_killed_at_update(n: int):
    """Within the block, learner rank 1's actor is killed at the start of the n-th group update; yields the
    count of updates called."""
    from ebpo.rl.learner_group import LearnerGroup

    calls, update = {"n": 0}, LearnerGroup.update

    def update_killing_rank_1_once(self, batch):
        calls["n"] += 1
        if calls["n"] == n:
            ray.kill(self.actors[1], no_restart=True)
        return update(self, batch)

    LearnerGroup.update = update_killing_rank_1_once
    try:
        yield calls
    finally:
        LearnerGroup.update = update


def _steps(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "actor/pg_loss" in r}


def _assert_same(a, b):
    keys = [k for k in a if k.startswith(COMPARED)]
    assert len(keys) > 10
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=2e-4, abs=1e-5), k


@pytest.mark.slow
def test_two_learner_ranks_train_like_one_and_resume(ray_local, tmp_path, data):
    common = ("trainer.steps=3", "trainer.tracking=none", "data.eval=null",
              "learner={n_draws: 2, mu: 1, minibatch_size: 3, lr: 0.001}")
    train(make_cfg(tmp_path, data, tmp_path / "w1", *common))
    two = ("learner={n_draws: 2, mu: 1, minibatch_size: 3, lr: 0.001, num_workers: 2, "
           "max_tokens_per_microbatch: 64}",)
    trainer, _ = train(make_cfg(tmp_path, data, tmp_path / "w2", *common, *two))
    assert len(trainer.learner.actors) == 2
    one, both = _steps(tmp_path / "w1"), _steps(tmp_path / "w2")
    assert sorted(one) == sorted(both) == [1, 2, 3]
    for step in (1, 2, 3):  # rollouts after step 1 use the synced weights: any divergence would compound
        _assert_same(one[step], both[step])
    # resume a 2-rank run from its step-2 checkpoint: step 3 repeats the uninterrupted run
    staged = tmp_path / "staged"
    train(make_cfg(tmp_path, data, staged, *common, *two, "trainer.stop_after=2", "trainer.save_every=1"))
    train(make_cfg(tmp_path, data, staged, *common, *two, f"trainer.resume={staged}"))
    _assert_same(both[3], _steps(staged)[3])

    # a learner rank killed at step 3: the group is rebuilt from the step-2 checkpoint, step 3 is redone
    # and equals the uninterrupted run's; the run finishes and counts the restart
    killed = tmp_path / "killed"
    with rank_1_killed_at_update(3) as calls:
        trainer, history = train(make_cfg(tmp_path, data, killed, *common, *two, "trainer.save_every=1"))
    assert calls["n"] == 4 and [h["step"] for h in history] == [1, 2, 3]
    assert history[-1]["faults/restarts"] == 1.0
    assert any("learner rank 1 failed" in e for e in trainer.events)
    _assert_same(both[3], _steps(killed)[3])
