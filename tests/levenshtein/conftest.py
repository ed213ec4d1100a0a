import pytest
import torch

from ebpo.model import LLaDA2MoeModelLM, tiny_config


@pytest.fixture(scope="module")
def small_model():
    """A 2-layer tiny LLaDA2-MoE (one dense, one MoE layer), block size 4, fp32, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=32, num_attention_heads=2,
                                             num_key_value_heads=1, block_size=4, initializer_range=0.2))
    return model.eval()
