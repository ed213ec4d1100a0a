"""recipes/quickstart_llada22_agent.yaml: the code-repair agent with every LLaDA2.2 piece on
(multi-turn with the sandboxed run_tests tool, DELETE / INSERT, L-EBPO, block routing, one step of staleness, the
additive reward); the control arm is the same recipe with override keys only. The run through `ebpo train` is
marked slow."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ebpo.infra.config import load_config
from ebpo.model.routing import block_routing_active
from ebpo.rl.config import RLConfig, model_config_of
from rollout import DecodeConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart_llada22_agent.yaml"
CONTROL = ["learner.levenshtein=false", "rollout.decode.tau_delete=-1", "rollout.decode.tau_insert=-1",
           "rollout.eval_decode.tau_delete=-1", "rollout.eval_decode.tau_insert=-1"]


@pytest.fixture
def cfg(monkeypatch):
    monkeypatch.chdir(ROOT)
    return load_config(RLConfig, RECIPE)


def test_recipe_turns_every_part_on(cfg):
    assert cfg.env.name == "code_repair" and cfg.env.multi_turn and cfg.learner.levenshtein
    assert cfg.trainer.max_staleness == 1
    for preset, decode in ((cfg.rollout.preset, cfg.rollout.decode), (cfg.rollout.eval_preset, cfg.rollout.eval_decode)):
        assert DecodeConfig.preset(preset, **decode).levenshtein
    model = model_config_of(cfg.model, cfg.model_overrides)
    assert (model.delete_token_id, model.insert_token_id) == (105, 106)  # named by the shipped model itself
    assert block_routing_active(model.block_routing_capacity, model.num_experts)
    weights = {f.fn: f.weight for f in cfg.reward.fns}
    assert set(weights) == {"task_completion", "tool_call_validity", "turn_format"} and all(w > 0 for w in weights.values())


def test_control_arm_is_override_keys_only(cfg):
    ctl = load_config(RLConfig, RECIPE, CONTROL)
    assert not ctl.learner.levenshtein
    for preset, decode in ((ctl.rollout.preset, ctl.rollout.decode), (ctl.rollout.eval_preset, ctl.rollout.eval_decode)):
        assert not DecodeConfig.preset(preset, **decode).levenshtein
    assert ctl.trainer == cfg.trainer and ctl.env == cfg.env and ctl.reward == cfg.reward


@pytest.mark.slow
def test_recipe_runs_through_ebpo_train(tmp_path):
    """Two steps through `ebpo train` (Ray, the multi-turn engine with DELETE / INSERT against the sandboxed tool,
    L-EBPO): the tool ran in the sandbox, the learner scored edit labels, step 2's rollouts came from step 1's
    weights, and held-out success was measured."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ebpo", "train", str(RECIPE), f"trainer.run_dir={run}",
                           "trainer.steps=2", "trainer.eval_every=2", "trainer.eval_size=8",
                           "trainer.filter_zero_std=false"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if r["step"] > 0 and "likelihood/lev_deletes_per_seq" in r}
    assert sorted(steps) == [1, 2]
    assert max(r["async/staleness_max"] for r in steps.values()) == 1
    assert all(r["actor/nonfinite_steps"] == 0 for r in steps.values())
    assert any("eval/accuracy" in r for r in rows if r["step"] == 2)
    assert json.loads((run / "init_model" / "config.json").read_text())["block_routing_capacity"] == 3
