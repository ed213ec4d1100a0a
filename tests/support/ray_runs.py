"""RL runs through real Ray actors on the tiny model (synchronous loop): an embedded Ray instance, a small
arithmetic data set, the recipe overrides every run shares, and the run's metrics. Import the fixtures you request
(`ray_local`, `data`) into the test module."""
import contextlib
import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ebpo.infra.config import load_config  # noqa: E402
from ebpo.rl.config import RLConfig  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b), "task": "math"} for a in range(3) for b in range(4)]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    held = tmp_path / "eval.jsonl"
    held.write_text("\n".join(json.dumps(r) for r in rows[:4]))
    return train, held


def make_cfg(tmp_path, data, run_dir, *extra):
    train, held = data
    overrides = [
        "model=preset:tiny@0", f"data.train={train}", f"data.eval={held}", f"trainer.run_dir={run_dir}",
        "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.decode={max_new_tokens: 16, temperature: 1.0}",
        "rollout.eval_decode={max_new_tokens: 8}", "trainer.tracking=wandb", "trainer.progress=false",
        "trainer.plots=true", "learner={n_draws: 2, mu: 1, lr: 0.001}", "reward.num_workers=1",
        "reward.timeout_s=5", *extra,
    ]
    return load_config(RLConfig, None, overrides)


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train(cfg):
    from ebpo.rl.trainer import make_loop

    trainer = make_loop(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return trainer, history


LEARNER_COMPARED = ("reward/", "actor/", "response_length/", "decode/", "likelihood/")


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


def learner_steps(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "actor/pg_loss" in r}


def assert_same_learner_step(a, b):
    keys = [k for k in a if k.startswith(LEARNER_COMPARED)]
    assert len(keys) > 10
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=2e-4, abs=1e-5), k
