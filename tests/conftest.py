import os

import pytest
import torch

from ebpo.model import LLaDA2MoeModelLM, tiny_config

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # torch missing is a different failure; let imports report it
        has_gpu = False
    if has_gpu:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def small_model():
    """A 2-layer tiny LLaDA2-MoE (one dense, one MoE layer), block size 4, fp32, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=32, num_attention_heads=2,
                                             num_key_value_heads=1, block_size=4, initializer_range=0.2))
    return model.eval()
