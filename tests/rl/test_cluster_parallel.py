"""A tensor / expert-parallel rollout worker in an RL run: the cluster's choice of worker class and resources,
the start-up checks of the layout, and (slow) a short `ebpo train` at tensor_parallel=2 against tensor_parallel=1."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebpo.infra.config import ConfigError, load_config
from ebpo.rl import cluster as cluster_mod
from ebpo.rl.config import RLConfig
from ebpo.rl.setup import check_rollout_parallel
from rollout.parallel_worker import ParallelRolloutWorker
from rollout.worker import RolloutWorker

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")


def _cfg(*overrides: str) -> RLConfig:
    return load_config(RLConfig, RECIPE, list(overrides))


def _actor(cls) -> tuple[type, dict]:
    """(the user class a Ray actor class wraps, its default resource options)."""
    return cls.__ray_metadata__.modified_class.__ray_actor_class__, cls._default_options


@pytest.mark.parametrize("tp, ep, ranks", [(2, 1, 2), (1, 2, 2), (2, 4, 4)])
def test_a_parallel_layout_is_one_parallel_worker_holding_the_gpus_of_its_ranks(tp, ep, ranks):
    cfg = _cfg(f"rollout.tensor_parallel={tp}", f"rollout.expert_parallel={ep}", "ray.rollout_gpus=1",
               "rollout.num_threads=8")
    cls, kwargs = cluster_mod.rollout_worker_class(cfg)
    user_cls, options = _actor(cls)
    assert user_cls is ParallelRolloutWorker
    assert options["num_gpus"] == ranks and options["num_cpus"] == 0
    # the ranks share the worker's threads: 8 in all
    assert kwargs == {"tensor_parallel": tp, "expert_parallel": ep, "num_threads": 8 // ranks}


def test_the_one_process_layout_keeps_the_plain_worker():
    cfg = _cfg("ray.rollout_gpus=0.5", "rollout.num_threads=3")
    cls, kwargs = cluster_mod.rollout_worker_class(cfg)
    user_cls, options = _actor(cls)
    assert user_cls is RolloutWorker and options["num_gpus"] == 0.5 and kwargs == {"num_threads": 3}


def test_a_colocated_parallel_worker_bundle_holds_every_rank_gpu(monkeypatch):
    """ray.colocate: the one node bundle must hold tp x rollout_gpus for the rollout worker plus the learner's GPU."""
    seen = {}

    class _Group:
        def wait(self, timeout_seconds):
            return True

    def fake_placement_group(bundles, strategy, name):
        seen.update(bundles=bundles, strategy=strategy)
        return _Group()

    monkeypatch.setattr(cluster_mod, "placement_group", fake_placement_group)
    cfg = _cfg("rollout.tensor_parallel=2", "ray.rollout_gpus=1", "ray.learner_gpus=1", "ray.colocate=true")
    cluster_mod.Cluster(cfg, "unused", [], lambda line: None)._place()
    assert seen["strategy"] == "STRICT_PACK"
    assert seen["bundles"] == [{"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]


@pytest.mark.parametrize("overrides, key", [
    (["rollout.tensor_parallel=2", "ray.rollout_gpus=0.5"], "ray.rollout_gpus = 0.5"),
    (["rollout.tensor_parallel=2", "env.agent=examples/agents/calculator_agent.py:calculator_agent"], "env.agent"),
    (["rollout.tensor_parallel=3"], "rollout.tensor_parallel = 3"),
])
def test_a_layout_the_worker_cannot_run_is_refused_naming_the_key(overrides, key):
    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_rollout_parallel(cfg, cfg.model)


def _train(run_dir: Path, tp: int) -> list[dict]:
    cmd = [sys.executable, "-m", "ebpo", "train", RECIPE, f"rollout.tensor_parallel={tp}", "trainer.steps=1",
           "trainer.eval_every=1", "trainer.eval_size=8", "trainer.progress=false", "trainer.plots=false",
           "trainer.tracking=none", "rollout.prompts_per_step=4", "rollout.group_size=4",
           f"trainer.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_tensor_parallel_run_trains_as_the_one_process_run(tmp_path):
    """Sampling is exact across tensor parallelism (each sequence draws from its own generator, the ranks'
    logits equal the one-process logits up to reduction order) and the learner is the same, so a step gives
    the same rewards and the same held-out accuracy; the losses are the learner's, from the same samples."""
    one, two = _train(tmp_path / "tp1", 1), _train(tmp_path / "tp2", 2)
    assert len(one) == len(two) > 0
    for a, b in zip(one, two):
        for key in ("reward/mean", "eval/accuracy"):
            if key in a:
                assert b[key] == a[key], (key, a, b)
