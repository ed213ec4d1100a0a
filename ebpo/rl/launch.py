"""Where an RL run lives and how it reaches Ray: the run directory (durable inside a Ray job) and the
arguments of `ray.init` (an embedded instance unless an address is given). Systems code, no algorithm.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from ebpo.infra.config import ConfigError


def in_ray_job() -> bool:
    """True inside the entrypoint of `ray job submit` (Ray sets this variable for the job's driver)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def resolve_run_dir(run_dir: str | None, name: str) -> Path:
    """The run directory as an absolute path: `run_dir`, or runs/NAME-TIME under the working directory.

    Inside a Ray job the working directory is Ray's temporary copy of the uploaded folder, deleted with
    the cluster session, so a relative (or default) run directory there would lose the checkpoints: it is
    refused with a ConfigError naming trainer.run_dir."""
    path = Path(run_dir) if run_dir else Path(f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if in_ray_job() and not path.is_absolute():
        raise ConfigError(f"trainer.run_dir: {str(path)!r} is relative, and this is a Ray job whose working "
                          f"directory ({os.getcwd()}) is a temporary copy deleted with the cluster session; set "
                          "trainer.run_dir (or trainer.resume) to an absolute path on storage every node can reach")
    return path.resolve()


def ray_init_kwargs(ray_cfg, warn: Callable[[str], None]) -> dict:
    """Arguments of `ray.init`: with an address (an existing cluster) the embedded-instance settings
    (`ray.num_cpus`) do not apply; Ray refuses them, so they are dropped with a warning."""
    kwargs = {"address": ray_cfg.address, "include_dashboard": False, "log_to_driver": False,
              "logging_level": logging.WARNING}
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        if ray_cfg.num_cpus is not None:
            warn(f"ray.num_cpus={ray_cfg.num_cpus} only sizes an embedded local Ray instance; ignored when "
                 f"connecting to the cluster at {address}")
    else:
        # "local" starts an embedded instance even when a `ray start` cluster runs on this machine, which
        # ray.init() would otherwise join (and then refuse num_cpus)
        kwargs.update(address="local", num_cpus=ray_cfg.num_cpus)
    return kwargs
