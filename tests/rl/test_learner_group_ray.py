"""The learner group inside the RL driver: learner.num_workers=2 Ray actors form a gloo group through Ray,
train like one learner (same metrics at every step), checkpoint and resume."""
import pytest

from tests.support.ray_runs import (assert_same_learner_step, data, learner_steps, make_cfg, ray,  # noqa: F401
                                    ray_local, rank_1_killed_at_update, train)

@pytest.mark.slow
def test_two_learner_ranks_train_like_one_and_resume(ray_local, tmp_path, data):
    common = ("trainer.steps=3", "trainer.tracking=none", "data.eval=null",
              "learner={n_draws: 2, mu: 1, minibatch_size: 3, lr: 0.001}")
    train(make_cfg(tmp_path, data, tmp_path / "w1", *common))
    two = ("learner={n_draws: 2, mu: 1, minibatch_size: 3, lr: 0.001, num_workers: 2, "
           "max_tokens_per_microbatch: 64}",)
    trainer, _ = train(make_cfg(tmp_path, data, tmp_path / "w2", *common, *two))
    assert len(trainer.learner.actors) == 2
    one, both = learner_steps(tmp_path / "w1"), learner_steps(tmp_path / "w2")
    assert sorted(one) == sorted(both) == [1, 2, 3]
    for step in (1, 2, 3):  # rollouts after step 1 use the synced weights: any divergence would compound
        assert_same_learner_step(one[step], both[step])
    # resume a 2-rank run from its step-2 checkpoint: step 3 repeats the uninterrupted run
    staged = tmp_path / "staged"
    train(make_cfg(tmp_path, data, staged, *common, *two, "trainer.stop_after=2", "trainer.save_every=1"))
    train(make_cfg(tmp_path, data, staged, *common, *two, f"trainer.resume={staged}"))
    assert_same_learner_step(both[3], learner_steps(staged)[3])

    # a learner rank killed at step 3: the group is rebuilt from the step-2 checkpoint, step 3 is redone
    # and equals the uninterrupted run's; the run finishes and counts the restart
    killed = tmp_path / "killed"
    with rank_1_killed_at_update(3) as calls:
        trainer, history = train(make_cfg(tmp_path, data, killed, *common, *two, "trainer.save_every=1"))
    assert calls["n"] == 4 and [h["step"] for h in history] == [1, 2, 3]
    assert history[-1]["faults/restarts"] == 1.0
    assert any("learner rank 1 failed" in e for e in trainer.events)
    assert_same_learner_step(both[3], learner_steps(killed)[3])
