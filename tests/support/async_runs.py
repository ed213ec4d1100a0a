"""RL runs through real Ray actors on the tiny model for the asynchronous and partial-rollout loops: a data set
with a reward the random tiny model earns unevenly (so the policy moves), the shared overrides, metrics per step and
a comparison of two runs' steps. Import the `data` fixture into the test module."""
import json
from pathlib import Path

import pytest

from ebpo.infra.config import load_config
from ebpo.rl.config import RLConfig


COMPARED = ("reward/", "actor/", "response_length/", "decode/", "train/", "likelihood/", "async/staleness")


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b), "task": "math"} for a in range(3) for b in range(4)]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    # a reward the random tiny model earns unevenly, so advantages are non-zero and the policy moves
    (tmp_path / "uneven.py").write_text("def score(*, completion, **_):\n    return (len(completion) % 3) / 2\n")
    return train


def make_cfg(data, run_dir, *extra):
    return load_config(RLConfig, None, [
        "model=preset:tiny@0", f"data.train={data}", f"reward.fns=[{{fn: '{data.parent / 'uneven.py'}:score'}}]",
        "data.eval=null", f"trainer.run_dir={run_dir}",
        "rollout.prompts_per_step=2", "rollout.group_size=3", "rollout.decode={max_new_tokens: 8, temperature: 1.0}",
        "trainer.tracking=none", "trainer.progress=false", "trainer.plots=false", "reward.num_workers=1",
        "reward.timeout_s=5", "rollout.num_threads=1", *extra])


def read_metrics(run_dir):
    return {r["step"]: r for r in (json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


def train(cfg, before_fit=None, loop=None):
    from ebpo.rl.trainer import make_loop

    trainer = make_loop(cfg) if loop is None else loop(cfg)
    try:
        if before_fit:
            before_fit(trainer)
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def assert_same_steps(a: dict, b: dict, steps):
    for step in steps:
        keys = [k for k in a[step] if k.startswith(COMPARED)]
        assert len(keys) > 15
        for k in keys:
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-6, abs=1e-7), (step, k)


LEARNER = "learner={n_draws: 2, mu: 1, lr: 0.001}"
