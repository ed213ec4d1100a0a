"""`LLaDA2MoeConfig` (ebpo.model.configuration_llada2_moe): bad fields fail naming the field; the edit-control token
fields and their validation."""
import pytest

from ebpo.model import LLaDA2MoeConfig, tiny_config
from ebpo.model.loading import load_model


@pytest.mark.parametrize("field,overrides", [
    ("n_group", dict(num_experts=6, n_group=4)),
    ("topk_group", dict(topk_group=9)),
    ("num_experts_per_tok", dict(num_experts_per_tok=7)),
    ("mask_token_id", dict(mask_token_id=500)),
    ("num_attention_heads", dict(num_attention_heads=3)),
    ("moe_impl", dict(moe_impl="fast")),
])
def test_config_errors_name_the_field(field, overrides):
    with pytest.raises(ValueError, match=rf"LLaDA2MoeConfig\.{field}"):
        tiny_config(**overrides)


def test_config_fields_and_validation():
    assert LLaDA2MoeConfig().delete_token_id is None  # released configs: no Levenshtein editing
    assert load_model("tiny-sft").config.delete_token_id is None
    with pytest.raises(ValueError, match="together"):
        tiny_config(delete_token_id=105, insert_token_id=None)
    with pytest.raises(ValueError, match="differ"):
        tiny_config(delete_token_id=2, insert_token_id=106)
    with pytest.raises(ValueError, match="inside the vocabulary"):
        tiny_config(delete_token_id=105, insert_token_id=500)
