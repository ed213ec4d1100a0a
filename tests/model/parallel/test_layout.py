"""Parallel layouts (ebpo.model.parallel.layout): which heads, KV heads, experts, units and vocabulary rows a rank
holds, and the start-up checks that name the field a layout cannot split."""
from __future__ import annotations

import pytest

from ebpo.model import load_preset, tiny_config
from ebpo.model.parallel import ParallelLayout, check_layout
from ebpo.model.parallel.sharding import qkv_rows


def _ranks(tp=1, ep=1, **kw):
    return [ParallelLayout(tp, t, ep, e, **kw) for t in range(tp) for e in range(ep)]


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 8), (8, 8, 4), (12, 4, 4),
                                         (16, 4, 8)])
def test_every_query_head_sits_with_the_kv_head_it_reads(heads, kv, tp):
    """Each rank holds heads / tp query heads and the KV heads they read (replicated when tp > KV heads);
    the ranks' query heads cover each head once."""
    config = tiny_config(num_attention_heads=heads, num_key_value_heads=kv, head_dim=16)
    group = heads // kv
    seen = []
    for layout in _ranks(tp):
        check_layout(config, layout)
        q, k = layout.q_heads(config), layout.kv_heads(config)
        assert len(q) == heads // tp and len(k) == max(kv // tp, 1)
        assert {h // group for h in q} == set(k)
        seen += list(q)
    assert sorted(seen) == list(range(heads))


def test_the_fused_qkv_rows_are_the_rank_heads_in_q_k_v_order():
    config = tiny_config()  # 4 heads, 2 KV heads, head_dim 32
    D, rows = config.head_dim, []
    for layout in _ranks(2):
        r = qkv_rows(config, layout)
        q, kv = layout.q_heads(config), layout.kv_heads(config)
        want = ([h * D + i for h in q for i in range(D)] + [(4 + h) * D + i for h in kv for i in range(D)]
                + [(6 + h) * D + i for h in kv for i in range(D)])
        assert r.tolist() == want
        rows += want
    assert sorted(rows) == list(range(8 * D))  # every row held once at tp = number of KV heads


def test_experts_vocabulary_and_units_are_split_in_contiguous_equal_parts():
    config = tiny_config()
    for getter, total, n in ((lambda L: L.experts(config), 8, 4), (lambda L: L.vocab(config), 128, 2),
                             (lambda L: L.dense_ffn(config), 384, 2), (lambda L: L.shared_ffn(config), 96, 2)):
        parts = [getter(L) for L in (_ranks(ep=n) if total == 8 else _ranks(tp=n))]
        assert [x for p in parts for x in p] == list(range(total))
    assert ParallelLayout(2, 1, shared_expert="replicate").shared_ffn(config) == range(96)


@pytest.mark.parametrize("overrides,layout,field", [
    (dict(), ParallelLayout(tp_size=3), "num_attention_heads"),
    (dict(num_attention_heads=12, num_key_value_heads=4), ParallelLayout(tp_size=6), "num_key_value_heads"),
    (dict(vocab_size=130), ParallelLayout(tp_size=4), "vocab_size"),
    (dict(intermediate_size=386), ParallelLayout(tp_size=4), "intermediate_size"),
    (dict(moe_intermediate_size=98), ParallelLayout(tp_size=4), "moe_intermediate_size"),
    (dict(), ParallelLayout(ep_size=3), "num_experts"),
    (dict(), ParallelLayout(tp_size=2, fp8=True), "head_dim"),
    (dict(head_dim=128, intermediate_size=128), ParallelLayout(tp_size=2, fp8=True), "intermediate_size"),
    (dict(), ParallelLayout(shared_expert="tensor"), "shared_expert"),
    (dict(), ParallelLayout(tp_size=2, tp_rank=2), "tp_rank"),
])
def test_a_layout_that_cannot_split_the_model_names_the_field(overrides, layout, field):
    with pytest.raises(ValueError, match=field):
        check_layout(tiny_config(**overrides), layout)


def test_the_shipped_presets_at_the_layouts_of_their_recipes():
    """flash on 8 ranks (TP 8, EP 8) in FP8 splits on 128-wide blocks; mini's shared expert (512 units) does not
    at TP 8 in FP8 and is replicated instead; a replicated shared expert needs no divisibility."""
    check_layout(load_preset("flash"), ParallelLayout(8, 3, 8, 5, fp8=True))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_layout(load_preset("mini"), ParallelLayout(8, 0, 8, 0, fp8=True))
    check_layout(load_preset("mini"), ParallelLayout(8, 0, 8, 0, shared_expert="replicate", fp8=True))
    check_layout(tiny_config(moe_intermediate_size=98), ParallelLayout(4, 0, shared_expert="replicate"))
