"""StreamingWeightLoader: a state dict loaded bucket by bucket equals the whole-dict load (plain and FP8),
and bad parts fail with the key named."""
import copy
import random

import pytest
import torch

from ebpo.model.loading import load_model
from rollout.weight_sync import pack_bucket, plan_buckets, unpack_bucket
from kernels.fp8 import convert_model_to_fp8, requantize_model_
from rollout.weight_loading import StreamingWeightLoader


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
