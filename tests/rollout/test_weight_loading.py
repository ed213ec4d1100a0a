"""StreamingWeightLoader: a state dict loaded bucket by bucket equals the whole-dict load (plain and FP8), and bad
parts fail with the key named.

StreamingWeightLoader (rollout/weight_loading.py) on tiny modules: which keys it expects (the model's own, or for an
FP8 model the unconverted model's), that parts load in place, and the errors naming the keys: an unknown key at
once, the keys no part delivered at `finish()` (how many, the first eight in sorted order)."""
import copy
import random

import pytest
import torch
from torch import nn

from ebpo.model.loading import load_model
from kernels.fp8 import convert_model_to_fp8, requantize_model_
from rollout.weight_loading import StreamingWeightLoader
from rollout.weight_sync import pack_bucket, plan_buckets, unpack_bucket


def parts_of(state_dict: dict, bucket_bytes: int) -> list[dict]:
    """The state dict as the broadcast delivers it: packed into buckets, unpacked one bucket at a time."""
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in state_dict.items()], bucket_bytes)
    return [unpack_bucket(pack_bucket(state_dict, b, "cpu").clone(), b) for b in plan]


def random_split(state_dict: dict, rng: random.Random) -> list[dict]:
    names = list(state_dict)
    rng.shuffle(names)
    cuts = sorted(rng.sample(range(1, len(names)), 5))
    return [{n: state_dict[n] for n in names[a:b]} for a, b in zip([0] + cuts, cuts + [len(names)])]


@pytest.mark.parametrize("bucket_bytes", [4096, 2**20])
def test_streamed_load_equals_load_state_dict(bucket_bytes):
    target = load_model("preset:tiny@1").state_dict()
    model = load_model("preset:tiny@0")
    loader = StreamingWeightLoader(model, fp8=False)
    parts = parts_of(target, bucket_bytes)
    assert (len(parts) > 10) == (bucket_bytes == 4096)
    for part in parts:
        loader.load_part(part)
    loader.finish()
    got = model.state_dict()
    assert got.keys() == target.keys()
    for k, v in target.items():
        assert torch.equal(got[k], v), k


def test_streamed_fp8_requantisation_equals_the_whole_dict_requantisation():
    base = load_model("preset:tiny@0")
    new = load_model("preset:tiny@1").state_dict()
    streamed, whole = convert_model_to_fp8(copy.deepcopy(base)), convert_model_to_fp8(copy.deepcopy(base))
    loader = StreamingWeightLoader(streamed, fp8=True)
    for part in random_split(new, random.Random(0)):
        loader.load_part(part)
    loader.finish()
    requantize_model_(whole, new)
    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].float(), b[k].float()), k


@pytest.mark.parametrize("fp8", [False, True])
def test_unknown_key_fails_at_once_and_a_missing_key_at_finish(fp8):
    model = load_model("preset:tiny@0")
    if fp8:
        model = convert_model_to_fp8(model)
    sd = load_model("preset:tiny@1").state_dict()
    loader = StreamingWeightLoader(model, fp8=fp8)
    with pytest.raises(ValueError, match="not.a.key"):
        loader.load_part({"not.a.key": torch.zeros(1)})
    loader = StreamingWeightLoader(model, fp8=fp8)
    loader.load_part({k: v for k, v in sd.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        loader.finish()


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
