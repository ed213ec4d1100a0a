"""recipes/agent_lev.yaml: multi-turn tool use, DELETE / INSERT in the rollouts, L-EBPO, block
routing and one step of staleness in one recipe; `model_overrides` names the edit-control tokens and switches block
routing on a checkpoint saved without them. The end-to-end run through `ebpo train` is marked slow (minutes)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ebpo.infra.config import ConfigError, load_config
from ebpo.model.loading import load_model
from ebpo.model.routing import block_routing_active
from ebpo.rl.config import RLConfig, model_config_of
from ebpo.rl.setup import write_init_model
from rollout import DecodeConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "agent_lev.yaml"


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.chdir(ROOT)
    return load_config(RLConfig, RECIPE)


def test_recipe_turns_every_part_on(cfg):
    assert cfg.env.multi_turn and cfg.learner.levenshtein and cfg.learner.t2t_weight == 0
    assert cfg.trainer.max_staleness == 1 and cfg.ray.weight_sync == "object_store"
    for preset, decode in ((cfg.rollout.preset, cfg.rollout.decode), (cfg.rollout.eval_preset, cfg.rollout.eval_decode)):
        assert DecodeConfig.preset(preset, **decode).levenshtein
    model = model_config_of(cfg.model, cfg.model_overrides)
    assert (model.delete_token_id, model.insert_token_id) == (105, 106)
    assert block_routing_active(model.block_routing_capacity, model.num_experts)
    shipped = model_config_of(cfg.model)  # the overrides are what turns them on
    assert shipped.delete_token_id is None and not block_routing_active(shipped.block_routing_capacity,
                                                                        shipped.num_experts)


def test_model_overrides_are_checked(cfg):
    with pytest.raises(ConfigError, match="model_overrides.*num_experts"):
        load_config(RLConfig, RECIPE, ["model_overrides={num_experts: 4}"])
    with pytest.raises(ConfigError, match="block_routing_capacity"):
        model_config_of(cfg.model, {"block_routing_capacity": 5})  # 8 experts in 4 groups, 2 kept: C <= 4
    with pytest.raises(ConfigError, match="insert_token_id"):
        model_config_of(cfg.model, {"delete_token_id": 105})  # named together or not at all


def test_init_model_is_the_checkpoint_with_the_overrides(cfg, tmp_path):
    out = write_init_model(cfg.model, cfg.model_overrides, tmp_path / "init_model")
    model, shipped = load_model(out), load_model(cfg.model)
    assert model.config.delete_token_id == 105 and model.config.block_routing_capacity == 3
    gates = [m.block_routing_capacity for m in model.modules() if hasattr(m, "block_routing_capacity")]
    assert gates and all(c == 3 for c in gates)
    a, b = model.state_dict(), shipped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same weights route differently: block routing is on
        assert not torch.equal(model(ids).logits, shipped(ids).logits)


@pytest.mark.slow
def test_recipe_runs_through_ebpo_train(tmp_path):
    """Three steps through `ebpo train` (Ray, the rollout worker's multi-turn engine with DELETE / INSERT, the
    learner's L-EBPO): the learner scores DELETE / INSERT labels recovered from the turns' drafts, the rollouts of
    steps 2 and 3 come from the previous weights, and held-out success is measured."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ebpo", "train", str(RECIPE), f"trainer.run_dir={run}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if r["step"] > 0 and "likelihood/lev_deletes_per_seq" in r}
    assert sorted(steps) == [1, 2, 3]
    assert sum(r["likelihood/lev_deletes_per_seq"] + r["likelihood/lev_inserts_per_seq"] for r in steps.values()) > 0
    assert max(r["async/staleness_max"] for r in steps.values()) == 1
    assert all(r["actor/nonfinite_steps"] == 0 for r in steps.values())
    assert any("eval/accuracy" in r for r in rows if r["step"] == 3)
    assert json.loads((run / "init_model" / "config.json").read_text())["block_routing_capacity"] == 3
