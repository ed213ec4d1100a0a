"""RL checkpoints, written and found by `ebpo.infra.checkpoint` (temporary folder, rename, `latest`,
`keep_last`), the layout every trainer shares. An RL checkpoint `checkpoints/step_N/` holds:

    learner/       every learner rank's state (`EBPOLearner.save`: weights, optimizer, noise generator)
    model/         the policy as a Hugging Face folder with the tokenizer (`ebpo export` reads it)
    in_flight.pt   asynchronous RL: the `StepRecord`s of the steps collected ahead of the learner
    partial.pt     partial rollouts: the driver's ledger and every rollout worker's carried sequences
    state.json     step, prompt-sampler position, weight version, W&B run id, the run's events
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ebpo.infra.checkpoint import latest_checkpoint, save_checkpoint
from ebpo.rl.partial_collect import restore_partial
from ebpo.rl.records import StepRecord
from ebpo.rl.run_state import RLRun



def save(run: RLRun, step: int, sampler: dict, in_flight: Optional[list[StepRecord]] = None) -> Path:
    """Checkpoint after `step`; `sampler`: the prompt sampler's state to resume from (after the in-flight
    steps' draws when there are any). Returns the checkpoint folder."""
    def write(folder: Path) -> None:
        run.learner.save(str(folder / "learner"))  # every rank writes its part before the rename
        run.learner.export(str(folder / "model"))
        run.tokenizer.save_pretrained(str(folder / "model"))
        if in_flight is not None:
            torch.save(in_flight, folder / "in_flight.pt")
        if run.partial is not None:  # partial rollouts: the sequences carried over, with their state
            from ebpo.rl.partial_collect import partial_state

            torch.save(partial_state(run), folder / "partial.pt")

    state = {"sampler": sampler, **run.weights.state(), "wandb_run_id": run.tracker.run_id,
             "events": list(run.events)}
    return save_checkpoint(run.run_dir, step, extra_state=state, keep_last=run.cfg.trainer.keep_last, save_fn=write)


def restore(run: RLRun) -> Optional[str]:
    """Restore the latest checkpoint into the run: learner, sampler, weight version, events, in-flight
    records; returns the W&B run id to continue."""
    path = latest_checkpoint(run.run_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {run.run_dir}/checkpoints")
    # checkpoints of ebpo 0.1 named their state file trainer_state.json
    state_file = path / "state.json" if (path / "state.json").exists() else path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    run.learner.load(str(path / "learner"))
    run.sampler.restore(state["sampler"])
    run.start_step = int(state["step"])
    run.weights.restore(state)
    run.events[:] = state.get("events", [])
    saved = path / "in_flight.pt"
    run.in_flight = torch.load(saved, weights_only=False) if saved.exists() else []
    if run.partial is not None:
        partial = path / "partial.pt"
        restore_partial(run, torch.load(partial, weights_only=False) if partial.exists() else None)
    return state.get("wandb_run_id")
