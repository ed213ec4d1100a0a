import pytest
import torch

from tests.support.models import decoding_lm


def make_model(seed=0, head_scale=8.0, eos_boost=0.0):
    """Random tiny model; lm_head scaled up so that confidences spread across the thresholds
    (`tests.support.models.decoding_lm`). eos_boost > 0 shifts the EOS logit up so that sequences stop early."""
    return decoding_lm(seed, head_scale, eos_boost)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding the tiny model is overhead-bound: one thread is faster and steadier on shared cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
