"""ebpo.infra.tracking (JSONL) and ebpo.infra.checkpoint (layout, latest pointer, keep-last, RNG round trip)."""
import json
import random

import numpy as np
import pytest
import torch

from ebpo.infra.checkpoint import capture_rng, load_latest, load_training_state, restore_rng, save_checkpoint
from ebpo.infra.tracking import Tracker


def test_tracker_jsonl_and_tables(tmp_path):
    t = Tracker(tmp_path, {"a": 1}, mode="none")
    t.log({"loss": torch.tensor(1.5), "bad": float("nan"), "n": 3}, step=2)
    t.log_table("samples", ["prompt", "completion"], [["1+1", "2"]], step=2)
    t.finish()
    t.finish()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 2 and rec["loss"] == 1.5 and rec["bad"] is None and rec["n"] == 3
    row = json.loads((tmp_path / "tables" / "samples.jsonl").read_text())
    assert row == {"step": 2, "prompt": "1+1", "completion": "2"}
    assert t.run_id is None
    with pytest.raises(ValueError, match="tracking mode"):
        Tracker(tmp_path, mode="tensorboard")


def test_rng_round_trip():
    g = torch.Generator().manual_seed(5)
    state = capture_rng({"g": g})
    a = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=g).item())
    restore_rng(state, {"g": g})
    b = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=g).item())
    assert a == b


def test_checkpoint_latest_and_keep_last(tmp_path):
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, optimizer=opt, extra_state={"k": step}, keep_last=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == ["step_2", "step_3"]
    step, path, state = load_latest(tmp_path)
    assert step == 3 and state["k"] == 3 and path.name == "step_3"
    opt2 = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    load_training_state(path, opt2)
    buf = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], buf)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_latest(tmp_path / "empty")
