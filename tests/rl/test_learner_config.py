"""The learner's configuration (ebpo.rl.learner_config, the recipe's `learner` section): validation naming the field,
deprecated aliases, the LoRA section shared with SFT, and the LR schedule shared with SFT."""
import pytest

from ebpo.infra.config import ConfigError, build
from ebpo.rl.learner import LearnerConfig, lr_factor
from ebpo.rl.learner_config import LearnerLora


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="learner.n_draws"):
        LearnerConfig(n_draws=0).validate()
    with pytest.raises(ValueError, match="learner.total_steps"):
        LearnerConfig(schedule="cosine", total_steps=0).validate()
    with pytest.raises(ConfigError, match="learner.schedule"):
        build(LearnerConfig, {"schedule": "linear"}, "learner.")
    with pytest.raises(ConfigError, match="learner.eps_low"):
        build(LearnerConfig, {"eps_low": 1.5}, "learner.")
    with pytest.raises(ConfigError, match="learner.noise"):
        build(LearnerConfig, {"noise": "uniform"}, "learner.")


def test_lr_schedule_shape():
    cfg = LearnerConfig(warmup_steps=2, total_steps=10, schedule="cosine")
    assert lr_factor(1.0, cfg) == pytest.approx(0.5)
    assert lr_factor(2.0, cfg) == pytest.approx(1.0)
    assert lr_factor(6.0, cfg) == pytest.approx(0.5)
    assert lr_factor(10.0, cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(0.0, cfg, 0.5) == pytest.approx(0.25)  # first step of the first update: non-zero
    assert lr_factor(5.0, LearnerConfig()) == 1.0


def test_learner_betas_is_a_deprecated_alias_of_beta1_beta2():
    with pytest.warns(DeprecationWarning, match="learner.beta1"):
        cfg = build(LearnerConfig, {"betas": [0.8, 0.95]}, "learner.")
    assert (cfg.beta1, cfg.beta2, cfg.betas) == (0.8, 0.95, None)
    assert (LearnerConfig().beta1, LearnerConfig().beta2) == (0.9, 0.999)  # the RL defaults are unchanged


def test_rl_and_sft_share_one_lr_schedule():
    from ebpo.core.schedule import lr_schedule
    from ebpo.rl.learner_config import lr_factor

    cfg = LearnerConfig(warmup_steps=2, total_steps=10, schedule="cosine")
    for p in (0.0, 0.5, 1.0, 2.0, 6.0, 9.5, 12.0):
        assert lr_factor(p, cfg, 0.5) == lr_schedule(p, 0.5, 2, 10, "cosine")


def test_learner_lora_is_the_sft_section_and_the_old_mapping_is_a_deprecated_alias():
    from ebpo.sft.config import LoraSection

    assert issubclass(LearnerLora, LoraSection)  # one spelling: enabled, r, alpha, dropout, target_modules
    assert build(LearnerConfig, {}, "learner.").lora.enabled is False
    assert build(LearnerConfig, {"lora": None}, "learner.").lora.enabled is False  # ebpo 0.1: null = off
    cfg = build(LearnerConfig, {"lora": {"enabled": True, "r": 4}}, "learner.")
    assert (cfg.lora.enabled, cfg.lora.r, cfg.lora.alpha) == (True, 4, 16.0)  # the RL defaults otherwise
    with pytest.warns(DeprecationWarning, match="learner.lora.enabled"):
        old = build(LearnerConfig, {"lora": {"r": 4, "alpha": 8}}, "learner.")  # ebpo 0.1: a mapping = on
    assert (old.lora.enabled, old.lora.r, old.lora.alpha) == (True, 4, 8.0)
    with pytest.raises(ConfigError, match="learner.lora.r"):
        build(LearnerConfig, {"lora": {"enabled": True, "r": 0}}, "learner.")
