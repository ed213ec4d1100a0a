"""The CPT/SFT recipe (ebpo.sft.config): bad values and unknown keys fail naming the key, when loaded and through
`ebpo train`."""
import pytest

from ebpo.infra.config import ConfigError, load_config
from ebpo.sft.config import SFTConfig


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="objective.t2t_rate"):
        load_config(SFTConfig, None, ["objective.t2t_rate=1.5"])
    with pytest.raises(ConfigError, match="trainer.backend"):
        load_config(SFTConfig, None, ["trainer.backend=jax"])
    with pytest.raises(ConfigError, match="optim.lrr"):
        load_config(SFTConfig, None, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="trainer.steps"):
        load_config(SFTConfig, None, ["trainer.steps=0"])
    from ebpo.cli.train import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: sft\nobjective:\n  mtf_fraction: 2\n")
    assert main([str(recipe)]) == 2
