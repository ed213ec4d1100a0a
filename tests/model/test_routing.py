"""LLaDA2.2 block routing (ebpo.model.routing): against plain-loop references, across every layout the project feeds
the model, and between the decoder and the learner.

Property test (hypothesis) of the admitted pool (`block_pool`) against a plain loop of the rule
(docs/background.md section 9): g = max over the unit's tokens of the biased scores; keep the `topk_group` groups
with the largest sum of their top-2 g; the pool is the top-C experts of g inside them."""
import math
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ebpo.core.likelihood import composite_logprobs, composite_logprobs_cached, draw_noise
from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.model.cache import BlockKVCache
from ebpo.model.masks import CopyBlockLayout, noisy_clean_position_ids, packed_noisy_clean_mask
from ebpo.model.routing import RoutingRecorder, block_pool, block_route, routing_units, set_block_routing
from rollout import DecodeConfig, generate
from rollout.layout import build_layout

K = 4


# ------------------------------------------------------------------------------------ plain-loop references
def brute_block_route(x, weight, bias, units, C, n_group, topk_group, k, scale):
    """Per token: sorted chosen experts and {expert: weight}, by the rule of docs/background.md section 9,
    one unit and one expert at a time."""
    T, E = x.shape[0], weight.shape[0]
    per = E // n_group
    s = [[1 / (1 + math.exp(-float(x[t] @ weight[e]))) for e in range(E)] for t in range(T)]
    choice = [[s[t][e] + float(bias[e]) for e in range(E)] for t in range(T)]
    pools = {}
    for u in sorted(set(units)):
        toks = [t for t in range(T) if units[t] == u]
        g = [max(choice[t][e] for t in toks) for e in range(E)]
        gscore = [sum(sorted(g[q * per:(q + 1) * per], reverse=True)[:2]) for q in range(n_group)]
        kept = sorted(range(n_group), key=lambda q: -gscore[q])[:topk_group]
        cand = [e for e in range(E) if e // per in kept]
        pools[u] = set(sorted(cand, key=lambda e: -g[e])[:C])
    idx, w = [], []
    for t in range(T):
        chosen = sorted(pools[units[t]], key=lambda e: -choice[t][e])[:k]
        total = sum(s[t][e] for e in chosen)
        idx.append(sorted(chosen))
        w.append({e: s[t][e] / total * scale for e in chosen})
    return idx, w, pools


def same_partition(ids: torch.Tensor, keys: list) -> bool:
    """ids (n,) and keys (n hashables) group the n tokens identically."""
    ids = ids.tolist()
    return all((ids[i] == ids[j]) == (keys[i] == keys[j]) for i in range(len(ids)) for j in range(len(ids)))


def block_model(capacity: int, **kw) -> LLaDA2MoeModelLM:
    """A 3-layer tiny model (2 MoE layers, 8 experts, k = 2, groups of 2), block size 4, block routing C."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = tiny_config(num_hidden_layers=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_attention_heads=2, num_key_value_heads=1, block_size=K, initializer_range=0.2,
                          block_routing_capacity=capacity, **kw)
        model = LLaDA2MoeModelLM(cfg)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.expert_bias.copy_(torch.randn(8) * 0.05)
    return model.eval()


# ------------------------------------------------------------------------------------ units and the gate
def test_routing_units_follow_blocks_and_streams():
    # a cached decode slice starting mid-sequence, two rows
    pos = torch.tensor([[8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    u = routing_units(pos, K)
    assert same_partition(u.reshape(-1), [(r, int(p) // K) for r in range(2) for p in pos[r]])
    # packed [noisy_1 ; noisy_2 ; clean], L = 10: copies are separate streams, even inside one block index
    L, S = 10, 2
    pos = noisy_clean_position_ids(L, S)[None]
    u = routing_units(pos, K)
    assert same_partition(u.reshape(-1), [(i // L, (i % L) // K) for i in range(L * (S + 1))])
    # one-block sequence, [noisy ; clean]: positions 0..2, 0..2 are two units
    assert same_partition(routing_units(torch.tensor([[0, 1, 2, 0, 1, 2]]), K).reshape(-1), [0, 0, 0, 1, 1, 1])
    # the decoder's padded layout: right-padding slots sit past the row's active block
    canvas = torch.arange(24).view(2, 12) % 7 + 3
    lay = build_layout(canvas, [4, 0], [8, 12], K, [None, None], 4, mask_id=2)
    u = routing_units(lay.position_ids, K)
    keys = [(r, int(p) // K) for r in range(2) for p in lay.position_ids[r]]
    assert same_partition(u.reshape(-1), keys)
    real = lay.valid.reshape(-1)
    pad_units = set(u.reshape(-1)[~real].tolist())
    assert not pad_units & set(u.reshape(-1)[real].tolist())


def test_gate_matches_brute_force():
    torch.manual_seed(1)
    cfg = tiny_config(num_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, block_routing_capacity=5)
    gate = LLaDA2MoeModelLM(cfg).model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.normal_()
        gate.expert_bias.copy_(torch.randn(16) * 0.5)  # large bias: admission must use the biased scores
    x = torch.randn(30, cfg.hidden_size) * 0.3
    units = torch.tensor([0] * 7 + [1] * 8 + [2] * 3 + [3] * 12)
    idx, w = gate(x, units)
    ref_idx, ref_w, pools = brute_block_route(x, gate.weight.detach(), gate.expert_bias, units.tolist(), 5, 4, 2, 3,
                                              cfg.routed_scaling_factor)
    for t in range(30):
        assert sorted(idx[t].tolist()) == ref_idx[t]
        for j, e in enumerate(idx[t].tolist()):
            assert abs(float(w[t, j]) - ref_w[t][e]) < 1e-5
    for u, pool in pools.items():  # at most C experts per unit, and the rule is not the per-token one
        assert set(idx[units == u].reshape(-1).tolist()) <= pool and len(pool) == 5
    with pytest.raises(ValueError, match="routing units"):
        gate(x)


def test_config_validation():
    with pytest.raises(ValueError, match="block_routing_capacity"):
        tiny_config(block_routing_capacity=1)  # < num_experts_per_tok = 2
    with pytest.raises(ValueError, match="block_routing_capacity"):
        tiny_config(block_routing_capacity=5)  # > topk_group * experts_per_group = 4 and < E = 8
    with pytest.raises(ValueError, match="block_routing_capacity"):
        tiny_config(block_routing_capacity=-1)
    for c in (0, 2, 4, 8, 100):
        assert tiny_config(block_routing_capacity=c).block_routing_capacity == c


# ------------------------------------------------------------------------------------ off = bit for bit
@pytest.mark.parametrize("capacity", [8, 9, 256])
def test_capacity_off_is_bit_for_bit(capacity):
    base, other = block_model(0), block_model(capacity)
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (2, 12))
    pos = noisy_clean_position_ids(12, 2)
    keep = packed_noisy_clean_mask(12, K, 2)[None, None]
    packed = torch.cat([ids, ids, ids], 1)
    for m in (base, other):
        m.zero_grad()
        m.train()
        m(packed, attention_mask=keep, position_ids=pos).logits.square().mean().backward()
        m.eval()
    assert torch.equal(base(ids).logits, other(ids).logits)
    assert torch.equal(base(packed, attention_mask=keep, position_ids=pos).logits,
                       other(packed, attention_mask=keep, position_ids=pos).logits)
    for (n, a), (_, b) in zip(base.named_parameters(), other.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    gens = [generate(m, [[5, 6, 7]], DecodeConfig.preset("quality", max_new_tokens=12, stop_at_eos=False))
            for m in (base, other)]
    assert gens[0][0].token_ids == gens[1][0].token_ids and gens[0][0].trace == gens[1][0].trace


# ------------------------------------------------------------------------------------ the bound, every layout
def _per_token(records, keep):
    """{(layer, key): sorted experts} for the tokens `keep(row, col, pos) -> key or None` selects."""
    out = {}
    for layer, pos, idx in records:
        for r in range(pos.shape[0]):
            for c in range(pos.shape[1]):
                key = keep(r, c, int(pos[r, c]))
                if key is not None:
                    out[(layer, key)] = tuple(sorted(idx[r, c].tolist()))
    return out


def _batch(B=2, L=14, P=3):
    torch.manual_seed(5)
    ids = torch.randint(3, 128, (B, L))
    resp = torch.zeros(B, L, dtype=torch.bool)
    resp[:, P:] = True
    noise = draw_noise(resp, K, 3, 0.1, 1.0, torch.Generator().manual_seed(2))
    return ids, noise


@pytest.mark.parametrize("capacity", [2, 3])
def test_at_most_capacity_experts_per_block_in_every_layout(capacity):
    model, free = block_model(capacity), block_model(0)
    ids, noise = _batch()
    counts = {}
    for name, m in (("on", model), ("off", free)):
        with RoutingRecorder(m) as rec, torch.no_grad():
            m(ids)  # block-causal
            composite_logprobs(m, ids, noise, [0, 1, 2], 2, packed=True)  # packed [noisy x3 ; clean]
            composite_logprobs(m, ids, noise, [0, 1], 2, packed=False)  # [noisy ; clean] rows
            composite_logprobs_cached(m, ids, noise, [0, 1, 2], 2)  # CopyBlockLayout + prefix cache
            generate(m, [[5, 6, 7], [8, 9, 10, 11, 12]], DecodeConfig.preset("quality", max_new_tokens=12))
        counts[name] = rec.experts_per_block(K, 8)
    assert int(counts["on"].max()) <= capacity
    assert int(counts["off"].max()) > capacity  # the bound is not vacuous for this model


def test_noisy_clean_and_cached_layouts_route_a_block_alike():
    model = block_model(3)
    ids, noise = _batch()
    B, L = ids.shape
    S = 3
    with RoutingRecorder(model) as plain, torch.no_grad():
        model(ids)
    with RoutingRecorder(model) as packed, torch.no_grad():
        composite_logprobs(model, ids, noise, [0, 1, 2], 2, packed=True)
    with RoutingRecorder(model) as pairs, torch.no_grad():
        composite_logprobs(model, ids, noise, [0, 1, 2], 2, packed=False)
    with RoutingRecorder(model) as cached, torch.no_grad():
        composite_logprobs_cached(model, ids, noise, [0, 1, 2], 2, group_tokens=1)  # one block per forward
    ref_clean = _per_token(plain.records, lambda r, c, p: ("clean", r, p))
    packed_t = _per_token(packed.records, lambda r, c, p: ("clean", r, p) if c >= S * L else ("noisy", c // L, r, p))
    pairs_t = _per_token(pairs.records, lambda r, c, p: ("clean", r % B, p) if c >= L else ("noisy", r // B, r % B, p))

    def cached_key(r, c, p):
        n_rows = len(cached.records[0][1])
        if n_rows == B:  # the clean-only prompt forward
            return ("clean", r, p)
        return ("clean", r - S * B, p) if r >= S * B else ("noisy", r // B, r % B, p)

    cached_t = _per_token(cached.records, cached_key)
    assert {k for k in packed_t if k[1][0] == "clean"} == set(ref_clean)
    for layout in (packed_t, pairs_t, cached_t):
        common = set(layout) & set(packed_t)
        assert len(common) >= len(ref_clean) - 2 * K * B  # cached skips the last clean block
        assert all(layout[k] == packed_t[k] for k in common)
        assert all(layout[k] == ref_clean[k] for k in set(layout) & set(ref_clean))
    noisy = [k for k in cached_t if k[1][0] == "noisy"]
    assert noisy and all(cached_t[k] == packed_t[k] == pairs_t[k] for k in noisy)


def test_training_routing_equals_the_decoders_last_forward_over_each_block():
    model = block_model(3)
    prompt = [5, 6, 7, 8, 9]
    cfg = DecodeConfig.preset("quality", max_new_tokens=19, stop_at_eos=False)  # canvas 24 = 6 blocks
    with RoutingRecorder(model) as dec, torch.no_grad():
        out = generate(model, [prompt], cfg)[0]
    seq = prompt + out.token_ids + out.tail_ids
    assert len(seq) % K == 0
    last = {}
    for layer, pos, idx in dec.records:  # batch 1: the last forward that ran a position wins
        for c in range(pos.shape[1]):
            last[(layer, int(pos[0, c]))] = tuple(sorted(idx[0, c].tolist()))
    ids = torch.tensor([seq])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, len(prompt):] = True
    noise = draw_noise(resp, K, 2, 0.1, 1.0, torch.Generator().manual_seed(0))
    with RoutingRecorder(model) as lrn, torch.no_grad():
        composite_logprobs(model, ids, noise, [0, 1], 2, packed=True)
    L = len(seq)
    clean = _per_token(lrn.records, lambda r, c, p: p if c >= 2 * L else None)
    assert set(clean) == set(last)
    assert all(clean[k] == last[k] for k in clean)


# ------------------------------------------------------------------------------------ the pool-only GEMM
FP32_U = torch.finfo(torch.float32).eps / 2  # unit roundoff, 2^-24


LAMBDA = 8.0  # probabilistic rounding-error bound: a sum of n terms is off by at most LAMBDA * sqrt(n) * u *


def swiglu_error_bound(experts, x, idx, w) -> torch.Tensor:
    """Elementwise bound on |fp32 experts(x, idx, w) - exact|, from the computation: the gate/up GEMMs
    (H terms each), silu (|silu'| <= 1.1) and the product with up to first order, then the down GEMM and
    the routing sum (E * F terms at most, zeros included, as in the dense path), each sum bounded by
    LAMBDA * sqrt(n) * u * sum|terms| with the magnitudes of this very input. Any summation order, blocking,
    FMA or vector width (the BLAS code path of a CPU) satisfies it; two paths differ by at most twice it."""
    E, F, H = experts.gate_proj.shape
    with torch.no_grad():
        route = torch.zeros(x.shape[0], E).scatter_add_(1, idx, w.abs())[..., None]
        g, up = (torch.einsum("th,efh->tef", x, p) for p in (experts.gate_proj, experts.up_proj))
        g_err, up_err = (LAMBDA * H ** 0.5 * FP32_U * torch.einsum("th,efh->tef", x.abs(), p.abs())
                         for p in (experts.gate_proj, experts.up_proj))
        h = torch.nn.functional.silu(g) * up
        h_err = (1.1 * g_err * up.abs() + torch.nn.functional.silu(g).abs() * up_err + 2 * FP32_U * h.abs()) * route
        down = experts.down_proj.abs()
        terms = torch.einsum("tef,ehf->th", h.abs() * route, down)
        return LAMBDA * (E * F) ** 0.5 * FP32_U * terms + torch.einsum("tef,ehf->th", h_err, down)


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_pool_only_gemm_equals_the_full_gemm(impl):
    model = block_model(3, moe_impl=impl)
    experts, gate = model.model.layers[1].mlp.experts, model.model.layers[1].mlp.gate
    torch.manual_seed(4)
    x = torch.randn(24, 64)
    units = torch.arange(24) // K
    idx, w, pool = gate.route(x, units)
    full = experts(x, idx, w)  # no pool: all E experts
    with torch.no_grad():
        only = experts(x, idx, w, pool)  # no grad: the GEMM runs over the admitted experts only
    # not a fixed atol: the outputs (~4) are small sums of terms ~100 times larger, so what two BLAS code
    # paths may differ by scales with the terms (an AMD machine's AVX-512 path differed by 3.3e-6)
    assert ((only - full).abs() <= 2 * swiglu_error_bound(experts, x, idx, w)).all()
    assert pool.any(0).sum() < 8  # the pool really is smaller than E here


def test_cached_decode_forward_matches_full_forward_routing():
    """The prefix cache does not change a block's routing: block 2 of a sequence routed in a cached forward
    (blocks 0-1 in the cache) equals its routing in the full block-causal forward."""
    model = block_model(2)
    torch.manual_seed(6)
    ids = torch.randint(3, 128, (1, 12))
    with RoutingRecorder(model) as full, torch.no_grad():
        model(ids)
    cache = BlockKVCache.for_model(model.config, 1, 12)
    with RoutingRecorder(model) as part, torch.no_grad():
        model(ids[:, :8], attention_mask=CopyBlockLayout(1, K), cache=cache)
        cache.commit(8)
        model(ids[:, 8:], cache=cache)
    a = _per_token(full.records, lambda r, c, p: p)
    b = _per_token(part.records, lambda r, c, p: p)
    assert set(a) == set(b) and all(a[k] == b[k] for k in a)


def test_set_block_routing_switches_a_loaded_model():
    model, ref = block_model(0), block_model(3)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    set_block_routing(model, 3)
    assert model.config.block_routing_capacity == 3 and torch.equal(model(ids).logits, ref(ids).logits)
    set_block_routing(model, 0)
    assert torch.equal(model(ids).logits, block_model(0)(ids).logits)
    with pytest.raises(ValueError, match="block_routing_capacity"):
        set_block_routing(model, 5)
    assert model.config.block_routing_capacity == 0


# bounded: a few seconds per test; no example database written into the tree
SETTINGS = settings(max_examples=150, deadline=timedelta(seconds=2), database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def routing(draw):
    n_group = draw(st.integers(1, 4))
    per = draw(st.integers(2, 4))
    E = n_group * per
    topk_group = draw(st.integers(1, n_group))
    capacity = draw(st.integers(1, topk_group * per))
    T = draw(st.integers(1, 8))
    units = draw(st.lists(st.integers(0, T - 1), min_size=T, max_size=T))
    # distinct powers of two: no ties anywhere (a sum of two distinct powers of two is unique), so the rule's
    # choice is unambiguous and the comparison exact; signs make some scores negative
    exps = [e - T * E // 2 for e in draw(st.permutations(range(T * E)))]  # |e| <= 64: exact in fp32
    signs = draw(st.lists(st.sampled_from([1.0, -1.0]), min_size=T * E, max_size=T * E))
    choice = torch.tensor([s * 2.0 ** e for s, e in zip(signs, exps)], dtype=torch.float32).view(T, E)
    return choice, torch.tensor(units), capacity, n_group, topk_group


def plain_pool(choice, units, capacity, n_group, topk_group):
    T, E = choice.shape
    per = E // n_group
    c = choice.tolist()
    pools = {}
    for u in set(units):
        toks = [t for t in range(T) if units[t] == u]
        g = [max(c[t][e] for t in toks) for e in range(E)]
        score = [sum(sorted(g[q * per:(q + 1) * per], reverse=True)[:2]) for q in range(n_group)]
        kept = sorted(range(n_group), key=lambda q: -score[q])[:topk_group]
        cand = [e for e in range(E) if e // per in kept]
        pools[u] = set(sorted(cand, key=lambda e: -g[e])[:capacity])
    return [pools[units[t]] for t in range(T)]


@SETTINGS
@given(routing())
def test_block_pool_is_the_plain_loop_of_the_rule(r):
    choice, units, capacity, n_group, topk_group = r
    pool = block_pool(choice, units, capacity, n_group, topk_group)
    ref = plain_pool(choice, units.tolist(), capacity, n_group, topk_group)
    assert pool.shape == choice.shape and (pool.sum(-1) == capacity).all()
    assert [set(row.nonzero().flatten().tolist()) for row in pool] == ref


@SETTINGS
@given(routing(), st.integers(1, 4))
def test_every_token_picks_its_top_k_inside_its_pool(r, k):
    choice, units, capacity, n_group, topk_group = r
    k = min(k, capacity)
    bias = torch.zeros(choice.shape[1])
    idx, pool = block_route(choice, bias, units, capacity, k, n_group, topk_group)
    ref = plain_pool(choice, units.tolist(), capacity, n_group, topk_group)
    for t in range(choice.shape[0]):
        want = sorted(ref[t], key=lambda e: -float(choice[t, e]))[:k]
        assert sorted(idx[t].tolist()) == sorted(want)
