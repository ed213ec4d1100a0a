"""recipes/rl_agent_llada22_mini.yaml: every LLaDA2.2 part the project supports at this size is on, and its
memory plan on one node of 8 x 80 GB (the README's table) fits with rows as long as a whole trajectory."""
from pathlib import Path

import pytest

from ebpo.infra.config import ConfigError, load_config
from ebpo.infra.memory_plan import GB
from ebpo.model.presets import load_preset
from ebpo.rl.config import RLConfig
from rollout.config import DecodeConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "rl_agent_llada22_mini.yaml"


def test_recipe_turns_the_llada22_parts_on():
    cfg = load_config(RLConfig, RECIPE)
    assert cfg.env.multi_turn and cfg.env.name == "calculator"
    for preset, decode in ((cfg.rollout.preset, cfg.rollout.decode), (cfg.rollout.eval_preset, cfg.rollout.eval_decode)):
        assert DecodeConfig.preset(preset, **decode).levenshtein  # DELETE / INSERT in rollouts and evaluation
    assert cfg.learner.levenshtein and cfg.learner.t2t_weight == 0
    # block routing at the preset's capacity, whatever the checkpoint's config says
    assert cfg.model_overrides == {"block_routing_capacity": load_preset("llada22_mini").block_routing_capacity}
    assert sorted(f.fn for f in cfg.reward.fns) == ["task_completion", "tool_call_validity", "turn_format"]
    assert [f.fn for f in cfg.reward.fns if f.judge] == ["task_completion"]


def test_staleness_one_is_refused_with_the_sharded_learner():
    """Why the recipe is synchronous (its header): asynchronous RL needs the torch backend."""
    with pytest.raises((ConfigError, ValueError), match="max_staleness"):
        load_config(RLConfig, RECIPE, ["trainer.max_staleness=1"])


def test_plan_fits_one_node_with_trajectory_long_rows():
    from ebpo.cli.plan import plan

    cfg = load_config(RLConfig, RECIPE, ["model=preset:llada22_mini"])
    p = plan(cfg, gpus_per_node=8, gpu_mem_gb=80.0, nodes=1)
    # a multi-turn row is up to env.turns.max_total_tokens, whatever decode.max_new_tokens says
    assert p["rollout"]["seq_len"] == cfg.env.turns.max_total_tokens
    longer = plan(load_config(RLConfig, RECIPE, ["model=preset:llada22_mini", "env.turns.max_total_tokens=4096",
                                                 "rollout.decode.max_new_tokens=16"]), 8, 80.0, 1)
    assert longer["rollout"]["seq_len"] == 4096 and longer["learner"]["row_len"] >= 4096
    assert p["learner"]["row_len"] >= cfg.env.turns.max_total_tokens
    assert p["model"]["block_routing_capacity"] == 48
    assert p["cluster"]["gpus_asked"] == 8
    for role in ("learner", "rollout"):
        assert p[role]["total"] <= 80 * GB, role
