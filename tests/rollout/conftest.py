import pytest
import torch

from ebpo.model import LLaDA2MoeModelLM, tiny_config


def make_model(seed=0, head_scale=8.0, eos_boost=0.0):
    """Random tiny model; lm_head scaled up so confidences spread across the thresholds.

    eos_boost > 0 shifts the EOS logit up so that sequences actually stop early.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LLaDA2MoeModelLM(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        if eos_boost:
            h = model.lm_head.weight.shape[1]
            model.lm_head.weight[model.config.eos_token_id] += eos_boost / h ** 0.5
    return model


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
