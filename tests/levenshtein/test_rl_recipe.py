"""recipes/rl_tiny_lev.yaml (L-EBPO against EBPO, docs/rl.md "Levenshtein editing and L-EBPO"): the recipe loads,
its rollouts decode with DELETE / INSERT on (else no rollout carries a pre-edit draft and L-EBPO is EBPO), its
model names the edit-control tokens, and the EBPO control differs from it only in learner.levenshtein."""
import json
from pathlib import Path

import pytest

from ebpo.infra.config import load_config, to_dict
from ebpo.model.loading import resolve_model_path
from ebpo.rl.config import RLConfig
from rollout import DecodeConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "rl_tiny_lev.yaml"


@pytest.fixture
def arms(monkeypatch):
    monkeypatch.chdir(ROOT)
    return load_config(RLConfig, RECIPE), load_config(RLConfig, RECIPE, ["learner.levenshtein=false"])


def test_recipe_is_l_ebpo_with_levenshtein_rollouts(arms):
    lebpo, ebpo = arms
    assert lebpo.learner.levenshtein and lebpo.learner.t2t_weight == 0 and not ebpo.learner.levenshtein
    roll = DecodeConfig.preset(lebpo.rollout.preset, **lebpo.rollout.decode)
    assert roll.levenshtein and roll.temperature == 1.0
    assert DecodeConfig.preset(lebpo.rollout.eval_preset, **lebpo.rollout.eval_decode).levenshtein
    cfg = json.loads((Path(resolve_model_path(lebpo.model)) / "config.json").read_text())
    assert cfg["delete_token_id"] is not None and cfg["insert_token_id"] is not None


def test_control_differs_only_in_the_learner_flag(arms):
    lebpo, ebpo = arms
    a, b = to_dict(lebpo), to_dict(ebpo)
    assert a["learner"].pop("levenshtein") is True and b["learner"].pop("levenshtein") is False
    assert a == b
