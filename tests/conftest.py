import os

import pytest

from tests.support.models import small_lm

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
    """A 2-layer tiny LLaDA2-MoE (one dense, one MoE layer), block size 4, fp32, eval mode
    (`tests.support.models.small_lm`)."""
    return small_lm().eval()
