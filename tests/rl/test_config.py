"""The RL recipe (ebpo.rl.config): what it accepts with an environment, the typed checks of its environment turns,
and `trainer.max_staleness` checked with the key named (one owner: the learner's key conflicts with it or is a
deprecated alias)."""
import pytest

from ebpo.infra.config import ConfigError, build
from ebpo.rl.config import RLConfig


@pytest.mark.parametrize("override", ["rollout.decode={mbe_window: 1}", "rollout.eval_decode={compiled_step: true}",
                                      "rollout.decode={tau_delete: 0.5, tau_insert: 0.5}", "learner.levenshtein=true"])
def test_decoding_features_and_l_ebpo_are_accepted_with_an_environment(override):
    """One rollout engine decodes single- and multi-turn alike, and L-EBPO scores multi-turn rows under the
    turn-aligned mask (tests/levenshtein/test_lev_multiturn.py): start-up refuses none of them with env.name."""
    from ebpo.infra.config import load_config

    cfg = load_config(RLConfig, None, ["env.name=calculator", override])
    assert cfg.env.multi_turn


def test_env_turns_are_typed_and_checked():
    cfg = build(RLConfig, {"env": {"name": "calculator", "turns": {"max_turns": 2}}})
    assert cfg.env.multi_turn and cfg.env.turns.max_turns == 2
    with pytest.raises(ConfigError, match="env.turns.max_turnz"):
        build(RLConfig, {"env": {"name": "calculator", "turns": {"max_turnz": 2}}})
    with pytest.raises(ConfigError, match="max_turns"):
        build(RLConfig, {"env": {"name": "calculator", "turns": {"max_turns": 0}}})
    assert not build(RLConfig, {}).env.multi_turn


def test_max_staleness_is_checked_with_the_key_named(tmp_path):
    from ebpo.infra.config import ConfigError, load_config
    from ebpo.rl.config import RLConfig

    for bad in ("-1", "1.5", "true"):
        with pytest.raises((ConfigError, ValueError), match="trainer.max_staleness"):
            load_config(RLConfig, None, [f"trainer.max_staleness={bad}"])
    with pytest.raises(ConfigError, match="trainer.max_staleness"):
        load_config(RLConfig, None, ["trainer.max_staleness=2", "ray.weight_sync=broadcast"])
    assert load_config(RLConfig, None, ["trainer.max_staleness=2"]).learner.max_staleness == 2
    with pytest.raises(ConfigError, match="learner.max_staleness"):
        load_config(RLConfig, None, ["trainer.max_staleness=1", "learner={backend: deepspeed}"])
    # one owner: the learner's key conflicts with the trainer's, or is a deprecated alias of it
    with pytest.raises(ConfigError, match="set trainer.max_staleness only"):
        load_config(RLConfig, None, ["trainer.max_staleness=1", "learner.max_staleness=2"])
    with pytest.warns(DeprecationWarning, match="trainer.max_staleness"):
        cfg = load_config(RLConfig, None, ["learner.max_staleness=2"])
    assert cfg.trainer.max_staleness == 2 and cfg.learner.max_staleness == 2
