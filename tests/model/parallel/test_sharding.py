"""Weight sharding (ebpo.model.parallel.sharding): every rank's slices put back together are exactly the full
model's parameters, the released per-expert names load like the stacked ones, FP8 ranks quantise their slices
into exactly the slices of the single-process quantisation, and bad streams are refused by name. No processes:
the loader needs only the layout (the groups matter to the forward alone)."""
from __future__ import annotations

import pytest
import torch

from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.model.parallel import ParallelLayout, ShardLoader, shard_model
from kernels.fp8 import FP8Experts, FP8Linear, convert_model_to_fp8

FP8_CONFIG = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                  intermediate_size=256, moe_intermediate_size=128, num_shared_experts=2)


def _full(**overrides):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LLaDA2MoeModelLM(tiny_config(initializer_range=0.2, **overrides)).eval()


def _shards(full, tp, ep, **kw):
    """{(tp rank, ep rank): that rank's state dict}."""
    return {(t, e): shard_model(full.state_dict(), full.config, ParallelLayout(tp, t, ep, e, **kw)).state_dict()
            for t in range(tp) for e in range(ep)}


def _qkv_parts(w, config):
    """(q, k, v) row blocks of a fused query_key_value weight."""
    nh, nkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return w[:nh * D], w[nh * D:(nh + nkv) * D], w[(nh + nkv) * D:]


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 1), (1, 4)])
def test_the_ranks_slices_put_back_together_are_the_full_parameters(tp, ep):
    full = _full(use_bias=True, use_qkv_bias=True)
    with torch.no_grad():  # biases start at zero: give them values a wrong split would change
        for name, p in full.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    config, want = full.config, full.state_dict()
    shards = _shards(full, tp, ep)
    by_tp = [shards[(t, 0)] for t in range(tp)]
    by_ep = [shards[(0, e)] for e in range(ep)]
    for name, w in want.items():
        if name.endswith("experts.gate_proj") or name.endswith("experts.up_proj") or name.endswith("experts.down_proj"):
            got = torch.cat([s[name] for s in by_ep])
        elif "query_key_value" in name:
            kv_every = max(tp // config.num_key_value_heads, 1)  # ranks sharing one KV head: take one of them
            parts = [_qkv_parts(s[name], tiny_config(num_attention_heads=config.num_attention_heads // tp,
                                                     num_key_value_heads=max(config.num_key_value_heads // tp, 1)))
                     for s in by_tp]
            got = torch.cat([torch.cat([p[0] for p in parts]),
                             torch.cat([p[1] for p in parts[::kv_every]]), torch.cat([p[2] for p in parts[::kv_every]])])
        elif name.endswith("attention.dense.bias"):
            got = sum(s[name] for s in by_tp)  # held once: the all-reduce adds it once
        elif name.endswith(("dense.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")):
            got = torch.cat([s[name] for s in by_tp], dim=1)
        elif name.endswith(("gate_proj.weight", "up_proj.weight", "word_embeddings.weight")) or name == "lm_head.weight":
            got = torch.cat([s[name] for s in by_tp])
        else:  # replicated: identical on every rank
            assert all(torch.equal(s[name], w) for s in shards.values()), name
            continue
        assert torch.equal(got, w), name


def test_released_per_expert_names_load_like_the_stacked_parameters():
    full = _full()
    per_expert = {}
    for name, w in full.state_dict().items():
        proj = name.rsplit(".", 1)[-1]
        if ".experts." in name and proj in ("gate_proj", "up_proj", "down_proj"):
            prefix = name.rsplit(".", 1)[0]
            per_expert.update({f"{prefix}.{e}.{proj}.weight": w[e] for e in range(w.shape[0])})
        else:
            per_expert[name] = w
    layout = ParallelLayout(2, 1, 2, 1)
    stacked = shard_model(full.state_dict(), full.config, layout).state_dict()
    model = shard_model(None, full.config, layout)
    loader = ShardLoader(model)
    kept = {name: loader.load(name, w) for name, w in per_expert.items()}
    loader.finish()
    assert not kept["model.layers.1.mlp.experts.0.gate_proj.weight"]  # expert 0 lives on ep rank 0
    assert kept["model.layers.1.mlp.experts.7.gate_proj.weight"]
    assert all(torch.equal(model.state_dict()[n], w) for n, w in stacked.items())


def test_loaded_slices_are_copies_so_the_full_tensor_can_go():
    full = _full()
    model = shard_model(iter(full.state_dict().items()), full.config, ParallelLayout(2, 0, 2, 0))
    storages = {w.untyped_storage().data_ptr() for w in full.state_dict().values()}
    assert not any(t.untyped_storage().data_ptr() in storages for t in model.state_dict().values())
    local = sum(t.numel() for t in model.state_dict().values())
    assert local < 0.6 * sum(t.numel() for t in full.state_dict().values())


def test_bad_streams_are_refused_by_name():
    full = _full()
    model = shard_model(None, full.config, ParallelLayout(2, 0))
    loader = ShardLoader(model)
    with pytest.raises(ValueError, match="unexpected parameter 'model.layers.0.attention.rotary'"):
        loader.load("model.layers.0.attention.rotary", torch.zeros(3))
    with pytest.raises(ValueError, match="unexpected parameter"):
        loader.load("model.layers.1.mlp.experts.8.gate_proj.weight", torch.zeros(3))
    with pytest.raises(ValueError, match="model.norm.weight"):
        loader.load("model.norm.weight", torch.zeros(7))
    loader.load("lm_head.weight", full.lm_head.weight)
    with pytest.raises(ValueError, match="never loaded"):
        loader.finish()
    assert "lm_head.weight" not in loader.missing() and "model.norm.weight" in loader.missing()
    loader.finish(allow_missing=True)


def _fp8_tensors(model):
    """{name: (fp8 weight as bytes, scale)} of every FP8 module."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            out[name + ".weight"] = (m.weight.view(torch.uint8), m.weight_scale)
        elif isinstance(m, FP8Experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[f"{name}.{proj}"] = (getattr(m, proj).view(torch.uint8), getattr(m, proj + "_scale"))
    return out


def test_fp8_ranks_quantise_exactly_the_slices_of_the_single_process_quantisation():
    """Shard, then quantise per rank: with 128-aligned slices each rank's E4M3 values and block scales are the
    single-process ones, cut the same way (rows of column-parallel layers, columns of row-parallel ones)."""
    full = _full(**FP8_CONFIG)
    want = _fp8_tensors(convert_model_to_fp8(_full(**FP8_CONFIG)))
    for t, e in ((0, 0), (0, 1), (1, 0), (1, 1)):
        layout = ParallelLayout(2, t, 2, e, fp8=True)
        got = _fp8_tensors(shard_model(full.state_dict(), full.config, layout))
        assert set(got) == set(want)
        for name, (q, s) in got.items():
            wq, ws = want[name]
            if ".experts." in name:
                rows = layout.experts(full.config)
                wq, ws = wq[rows.start:rows.stop], ws[rows.start:rows.stop]
            elif name.endswith(("dense.weight", "down_proj.weight")):
                n = wq.shape[1] // 2
                wq, ws = wq[:, t * n:(t + 1) * n], ws[:, t * n // 128:(t + 1) * n // 128]
            elif "query_key_value" in name:  # one q, one k, one v head per rank: 128-row blocks t, 2 + t, 4 + t
                blocks = [t, 2 + t, 4 + t]
                wq = torch.cat([wq[b * 128:(b + 1) * 128] for b in blocks])
                ws = ws[blocks]
            else:
                n = wq.shape[0] // 2
                wq, ws = wq[t * n:(t + 1) * n], ws[t * n // 128:(t + 1) * n // 128]
            assert torch.equal(q, wq) and torch.equal(s, ws), name


def test_a_weight_sync_into_an_fp8_model_requantises_the_slices():
    full = _full(**FP8_CONFIG)
    layout = ParallelLayout(2, 1, 2, 0, fp8=True)
    built = _fp8_tensors(shard_model(full.state_dict(), full.config, layout))
    model = shard_model(None, full.config, layout)  # FP8 from the start, weights to come
    ShardLoader(model).load_all(full.state_dict().items()).finish()
    synced = _fp8_tensors(model)
    assert all(torch.equal(synced[n][0], q) and torch.equal(synced[n][1], s) for n, (q, s) in built.items())
