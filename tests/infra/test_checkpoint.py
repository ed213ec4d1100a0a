"""ebpo.infra.checkpoint: the layout, the latest pointer, keep-last and the RNG round trip."""
import random

import numpy as np
import pytest
import torch

from ebpo.infra.checkpoint import capture_rng, load_latest, load_training_state, restore_rng, save_checkpoint


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
