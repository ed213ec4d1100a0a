"""Launching on an existing Ray cluster (ebpo.rl.launch): embedded-only settings do not break `ray.init`, a Ray job
refuses a run directory inside its temporary working copy, and (slow) the quickstart submitted as a Ray job writes
its checkpoint where the user asked."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebpo.infra.config import ConfigError
from ebpo.rl.config import RayConfig
from ebpo.rl.launch import ray_init_kwargs, resolve_run_dir

ROOT = Path(__file__).resolve().parents[2]


def test_num_cpus_is_dropped_with_a_warning_when_connecting(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    warnings = []
    local = ray_init_kwargs(RayConfig(num_cpus=2), warnings.append)
    assert local["num_cpus"] == 2 and local["address"] == "local" and not warnings
    remote = ray_init_kwargs(RayConfig(address="auto", num_cpus=2), warnings.append)
    assert "num_cpus" not in remote and remote["address"] == "auto"
    assert len(warnings) == 1 and "ray.num_cpus" in warnings[0]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # what a Ray job's driver sees
    assert "num_cpus" not in ray_init_kwargs(RayConfig(num_cpus=2), warnings.append)


def test_run_dir_is_absolute_and_refused_relative_inside_a_ray_job(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert resolve_run_dir("runs/x", "q") == tmp_path / "runs" / "x"
    assert resolve_run_dir(None, "q").parent == tmp_path / "runs"
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    for relative in ("runs/x", None):
        with pytest.raises(ConfigError, match="trainer.run_dir"):
            resolve_run_dir(relative, "q")
    assert resolve_run_dir(str(tmp_path / "abs"), "q") == tmp_path / "abs"


@pytest.mark.slow
def test_quickstart_as_a_ray_job_writes_its_checkpoint_where_asked(tmp_path):
    """`ray start --head`, then `ray job submit ... -- ebpo train recipes/quickstart.yaml ray.address=auto` for
    two steps, with token authentication on the client side, as the README's launch lines say."""
    from ebpo.infra.distributed import free_port

    port, dash = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run(ray + ["start", "--head", f"--port={port}", f"--dashboard-port={dash}", "--num-cpus=2",
                          "--include-dashboard=true"], check=True, capture_output=True, env=env, timeout=180)
    run_dir = tmp_path / "cluster-run"
    try:
        job = subprocess.run(
            ray + ["job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", str(ROOT),
                   "--runtime-env-json", '{"excludes": [".git", "runs", "wandb"]}', "--",
                   sys.executable, "-m", "ebpo", "train", "recipes/quickstart.yaml", "ray.address=auto",
                   "trainer.steps=2", "trainer.save_every=2", "trainer.tracking=none", "data.eval=null",
                   "trainer.progress=false", "trainer.plots=false", "rollout.prompts_per_step=4",
                   "trainer.dynamic_sampling=0", f"trainer.run_dir={run_dir}"],
            capture_output=True, text=True, env=env, timeout=600)
        assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
        assert f"run directory {run_dir}" in job.stdout
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
        assert (run_dir / "checkpoints" / "step_2" / "model" / "config.json").exists()
    finally:
        subprocess.run(ray + ["stop", "--force"], capture_output=True, timeout=120)
