"""StreamingWeightLoader (rollout/weight_loading.py) on tiny modules: which keys it
expects (the model's own, or for an FP8 model the unconverted model's), that parts load in place, and the
errors naming the keys: an unknown key at once, the keys no part delivered at `finish()` (how many, the first
eight in sorted order)."""
import pytest
import torch
from torch import nn

from kernels.fp8 import convert_model_to_fp8
from rollout.weight_loading import StreamingWeightLoader


def tiny(seed=0, n=3):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16, bias=i % 2 == 0) for i in range(n)], nn.LayerNorm(16))


def test_plain_expected_keys_and_streamed_parts():
    model, target = tiny(0), tiny(1).state_dict()
    loader = StreamingWeightLoader(model)
    assert loader.fp8 is False and loader.model is model
    assert loader.expected == set(model.state_dict()) and loader.loaded == set()
    names = sorted(target)
    for a in range(0, len(names), 2):
        loader.load_part({k: target[k] for k in names[a:a + 2]})
    loader.finish()
    for k, v in model.state_dict().items():
        assert torch.equal(v, target[k]), k


@pytest.mark.parametrize("fp8", [False, True])
def test_finish_names_the_missing_keys(fp8):
    model = tiny(0, n=12)
    if fp8:
        model = convert_model_to_fp8(model)
    src = tiny(1, n=12).state_dict()
    loader = StreamingWeightLoader(model, fp8=fp8)
    assert loader.fp8 is fp8
    assert loader.expected == set(src)  # FP8: the unconverted names, no weight_scale
    with pytest.raises(ValueError) as err:
        loader.finish()  # nothing delivered: every key missing
    missing = sorted(src)
    assert str(err.value) == f"weight load: {len(missing)} keys never arrived, e.g. {missing[:8]}"
    keep = sorted(src)[::3]
    loader.load_part({k: src[k] for k in keep})
    with pytest.raises(ValueError) as err:
        loader.finish()
    missing = sorted(set(src) - set(keep))
    assert len(missing) > 8
    assert str(err.value) == f"weight load: {len(missing)} keys never arrived, e.g. {missing[:8]}"
    loader.load_part({k: src[k] for k in missing})
    loader.finish()  # everything arrived: no error


def test_unexpected_key_fails_at_once():
    loader = StreamingWeightLoader(tiny(0))
    with pytest.raises(ValueError, match=r"unexpected keys \['x.weight', 'y'\]"):
        loader.load_part({"y": torch.zeros(1), "x.weight": torch.zeros(1)})
