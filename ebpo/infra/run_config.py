"""The run directory's recorded configuration: written once, compared on resume, never overwritten.

A fresh run writes `RUN/config.yaml` after the whole configuration has been checked (so a bad key
leaves no directory behind). A resume (`trainer.resume=RUN`) compares the new configuration with the
recorded one, key by key:

- keys that only change how the run is executed or observed (evaluation size, checkpoint cadence,
  tracking, resources, ...) are accepted;
- any other change alters what the run learns (rewards, data, model, algorithm) and is refused unless
  `trainer.resume_changes` names the key or a section holding it (`reward`, `learner.lr`, ...).

Accepted changes are appended to `RUN/config_changes.yaml`, beside the original, with the time.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

import yaml

from ebpo.infra.config import ConfigError

# Keys whose change on resume leaves what the run learns as it was (dotted keys; a trailing "." is a
# whole section). Everything else counts as learning-altering.
OPERATIONAL_KEYS = (
    "name", "trainer.run_dir", "trainer.resume", "trainer.resume_changes", "trainer.stop_after",
    "trainer.eval_every", "trainer.eval_size", "trainer.save_every", "trainer.keep_last", "trainer.tracking",
    "trainer.wandb_project", "trainer.samples_per_step", "trainer.max_retries", "trainer.progress",
    "trainer.plots", "trainer.log_every", "trainer.num_threads", "trainer.export_dir", "trainer.export_dtype",
    "trainer.gradient_checkpointing", "ray.", "rollout.num_workers", "rollout.num_threads", "rollout.eval_preset",
    "rollout.eval_decode", "reward.num_actors", "reward.num_workers", "learner.num_workers",
    "learner.max_tokens_per_microbatch", "learner.gradient_checkpointing", "data.eval", "eval.",
)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1}; lists and scalars are leaves (a list of rewards is one
    value); an empty section has no leaves, so `learner: {}` and an unset learner section compare equal."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _covered(key: str, names: Iterable[str]) -> bool:
    """`key` equals one of `names` or lies inside one of them (a section)."""
    return any(key == n or key.startswith(n if n.endswith(".") else n + ".") for n in names)


def config_changes(recorded: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (recorded value, current value) for every key whose value differs (a key present on
    one side only counts, with None on the other)."""
    old, new = flatten(recorded), flatten(current)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def check_resume(recorded: dict, current: dict, allowed: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """The changes of a resume, checked: raises ConfigError naming every learning-altering change that
    `allowed` (trainer.resume_changes) does not name; returns all changes otherwise."""
    allowed = list(allowed)
    changes = config_changes(recorded, current)
    refused = {k: v for k, v in changes.items() if not _covered(k, OPERATIONAL_KEYS) and not _covered(k, allowed)}
    if refused:
        lines = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        names = ",".join(sorted(refused))
        raise ConfigError(f"trainer.resume: this configuration changes what the run learns ({lines}); resume "
                          f"with the recorded configuration, or accept the change with "
                          f"trainer.resume_changes=[{names}] (it is then recorded in config_changes.yaml)")
    return changes


def open_run_dir(run_dir: Path, config: dict, resume: bool, allowed: Iterable[str] = (), write: bool = True) -> Path:
    """Create (or, on resume, check) the run directory and record its configuration; returns `run_dir`.

    Call it only after the whole configuration has been validated: it is the first thing that writes.
    A fresh run writes `config.yaml`; a resume never touches it, checks the changes (`check_resume`) and
    appends the accepted ones to `config_changes.yaml`. Raises ConfigError (nothing written) on a resume
    of a directory with no recorded configuration or with refused changes.
    """
    recorded_path = run_dir / "config.yaml"
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        recorded_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return run_dir
    if not recorded_path.exists():
        raise ConfigError(f"trainer.resume: {run_dir} holds no config.yaml; is it a run directory?")
    recorded = flatten(yaml.safe_load(recorded_path.read_text()) or {})
    log_path = run_dir / "config_changes.yaml"
    entries = (yaml.safe_load(log_path.read_text()) or []) if log_path.exists() else []
    for entry in entries:  # the configuration in force: the original plus every change accepted since
        recorded.update({k: change["now"] for k, change in entry["changes"].items()})
    changes = check_resume(recorded, flatten(config), allowed)
    if changes and write:
        entries.append({"time": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "changes": {k: {"recorded": old, "now": new} for k, (old, new) in changes.items()}})
        log_path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return run_dir
