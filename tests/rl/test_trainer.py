"""End-to-end RL through real Ray actors on the tiny model (random init: fast and independent of training)."""
import math

import pytest

ray = pytest.importorskip("ray")

from tests.support.ray_runs import data, make_cfg, ray_local, read_metrics, train  # noqa: E402,F401

DESIGN_METRICS = [
    "reward/mean", "reward/std", "reward/math/mean", "reward/timeouts", "reward/errors", "frac_zero_std_groups",
    "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "decode/tpf", "decode/forwards", "decode/edits_per_seq", "decode/lev_share",
    "actor/pg_loss", "actor/clipfrac_low", "actor/clipfrac_high", "actor/clipfrac_dual", "actor/log_ratio_mean",
    "actor/kl",
    "actor/grad_norm", "actor/lr",
    "timing_s/rollout", "timing_s/reward", "timing_s/old_logprob", "timing_s/update", "timing_s/sync", "timing_s/step",
    "perf/rollout_tokens_per_s", "perf/train_tokens_per_s",
]


def test_two_steps_log_every_design_metric_and_checkpoint(ray_local, tmp_path, data, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    trainer, history = train(make_cfg(tmp_path, data, run_dir, "trainer.steps=2", "trainer.save_every=1"))
    assert [h["step"] for h in history] == [1, 2]
    for name in DESIGN_METRICS:
        for h in history:
            assert name in h, name
            assert math.isfinite(h[name]), (name, h[name])
    logged = read_metrics(run_dir)
    assert any("eval/math/accuracy" in r for r in logged)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert (run_dir / "checkpoints" / "step_2" / "state.json").exists()
    assert (run_dir / "config.yaml").exists()
    assert list((run_dir / "plots").glob("*.png"))
    assert list(run_dir.rglob("*.wandb")), "an offline W&B run should be written inside the run directory"


def test_resume_repeats_the_uninterrupted_run(ray_local, tmp_path, data):
    full, _ = train(make_cfg(tmp_path, data, tmp_path / "full", "trainer.steps=3", "trainer.tracking=none",
                             "data.eval=null"))
    staged_dir = tmp_path / "staged"
    train(make_cfg(tmp_path, data, staged_dir, "trainer.steps=3", "trainer.stop_after=2", "trainer.tracking=none",
                   "data.eval=null"))
    assert not any(r["step"] == 3 for r in read_metrics(staged_dir))
    train(make_cfg(tmp_path, data, staged_dir, "trainer.steps=3", f"trainer.resume={staged_dir}",
                   "trainer.tracking=none", "data.eval=null"))
    a = [r for r in read_metrics(tmp_path / "full") if r["step"] == 3][0]
    b = [r for r in read_metrics(staged_dir) if r["step"] == 3][0]
    compared = [k for k in a if k.startswith(("reward/", "actor/", "response_length/", "decode/"))]
    assert len(compared) > 10
    for k in compared:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k


def test_killed_reward_actor_is_replaced_and_the_run_goes_on(ray_local, tmp_path, data):
    from ebpo.rl.trainer import make_loop

    trainer = make_loop(make_cfg(tmp_path, data, tmp_path / "k", "trainer.steps=2", "trainer.tracking=none",
                                 "data.eval=null"))
    try:
        trainer.step(1)
        ray.kill(trainer.run.cluster.reward_workers[0].handle, no_restart=True)
        metrics = trainer.step(2)
    finally:
        trainer.close()
    assert metrics["faults/restarts"] == 1.0
    assert math.isfinite(metrics["reward/mean"]) and math.isfinite(metrics["actor/pg_loss"])
    assert any("reward-0 died" in e for e in trainer.events)


def test_custom_reward_file_is_called(ray_local, tmp_path, data):
    calls = tmp_path / "calls.txt"
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def score(*, prompt, completion, answer=None, tests=None, metadata=None, **_):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(prompt.replace('\\n', ' ') + '\\n')\n"
        "    return 0.25\n")
    _, history = train(make_cfg(tmp_path, data, tmp_path / "c", "trainer.steps=1", "trainer.tracking=none",
                                "data.eval=null", f"reward.fns=[{{fn: '{reward_file}:score'}}]",
                                "ray.colocate=true", "name=colocated"))
    lines = calls.read_text().splitlines()
    assert len(lines) >= 6  # 2 prompts x 3 samples (+ the start-up dry run)
    assert all(line.startswith("What is") for line in lines)
    assert history[0]["reward/mean"] == pytest.approx(0.25)
    # ray.colocate=true: rollout + learner ran in one STRICT_PACK placement group, released at close
    groups = [g for g in ray.util.placement_group_table().values() if g["name"] == "colocated-policy"]
    assert len(groups) == 1 and groups[0]["strategy"] == "STRICT_PACK" and groups[0]["state"] == "REMOVED"


def test_dynamic_sampling_draws_until_enough_groups_carry_signal(ray_local, tmp_path, data):
    """P=2 prompts a step, up to 3 extra rounds. Only `What is 2+b?` prompts (4 of 12) can score unequally
    inside a group (the parity of the completion's characters), so the trainer must keep drawing."""
    reward_file = tmp_path / "parity.py"
    reward_file.write_text(
        "def score(*, prompt, completion, **_):\n"
        "    return float(sum(map(ord, completion)) % 2) if prompt.startswith('What is 2+') else 0.0\n")
    common = ["trainer.tracking=none", "trainer.plots=false", "data.eval=null", "trainer.filter_zero_std=true",
              "trainer.dynamic_sampling=3"]
    P, G, rounds = 2, 3, 4
    _, history = train(make_cfg(tmp_path, data, tmp_path / "ds", "trainer.steps=3", *common,
                                f"reward.fns=[{{fn: '{reward_file}:score'}}]"))
    for h in history:
        drawn = int(h["train/prompts_drawn"])
        informative = round((1 - h["frac_zero_std_groups"]) * drawn)
        assert drawn % P == 0 and P <= drawn <= rounds * P
        assert informative >= P or drawn == rounds * P  # stopped as soon as P groups had signal, or gave up
        assert h["train/samples"] == G * min(P, informative)  # the learner takes at most P groups
    # math on a random-init model: every group scores all-zero, so every round is drawn and nothing trains
    _, history = train(make_cfg(tmp_path, data, tmp_path / "ds0", "trainer.steps=1", *common))
    assert history[0]["train/prompts_drawn"] == rounds * P and history[0]["train/samples"] == 0


def test_dynamic_sampling_needs_the_zero_std_filter(tmp_path, data):
    with pytest.raises(ValueError, match="trainer.dynamic_sampling"):
        make_cfg(tmp_path, data, tmp_path / "x", "trainer.dynamic_sampling=2", "trainer.filter_zero_std=false")
