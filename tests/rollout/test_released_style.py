"""The released-style baseline of `ebpo bench decode --vs-released` decodes the same tokens as `rollout.generate`
(one prompt at a time, no cache, full logits: only the organisation of the work differs)."""
import pytest
import torch
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve

from ebpo.bench.released import released_style_generate
from rollout import DecodeConfig, generate


@pytest.mark.parametrize("preset,extra,eos_boost", [
    ("quality", {}, 0.0), ("speed", {}, 0.0), ("m2t", {}, 0.0),
    ("quality", {"temperature": 0.8, "top_p": 0.9}, 0.0), ("speed", {"repetition_penalty": 3.0}, 0.0),
    ("quality", {}, 6.0), ("m2t", {"stop_at_eos": False}, 6.0),
])
def test_released_style_loop_gives_our_tokens(preset, extra, eos_boost):
    model = make_model(seed=1, eos_boost=eos_boost)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 8, 13, 0, 21)]
    cfg = DecodeConfig.preset(preset, max_new_tokens=40, **extra)
    # one sequence at a time, as the released loop decodes: batching changes GEMM shapes, and under some CPU
    # code paths (ATEN_CPU_CAPABILITY=avx2) that float noise flips a near-tie argmax of this random model
    ours = generate(model, prompts, cfg, seeds=list(range(len(prompts))), max_batch=1)
    theirs = [released_style_generate(model, p, cfg, torch.Generator().manual_seed(i) if cfg.temperature else None)
              for i, p in enumerate(prompts)]
    assert [o.token_ids for o in ours] == theirs
