"""ebpo.infra.tracking: the JSONL tracker and its tables."""
import json

import pytest
import torch

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
