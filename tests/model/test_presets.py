"""Named model presets (ebpo.model.presets): the real presets build their configurations; an unknown name lists the
choices."""
import pytest


def test_real_presets_build_configs():
    from ebpo.model import load_preset

    mini = load_preset("mini")
    assert (mini.hidden_size, mini.num_experts, mini.vocab_size, mini.mask_token_id) == (2048, 256, 157184, 156895)
    assert load_preset("flash").num_hidden_layers == 32
    with pytest.raises(ValueError, match="choose one of"):
        load_preset("huge")
