"""Property test (hypothesis) of block routing's admitted pool (ebpo.model.routing.block_pool) against a plain
loop of the rule (docs/background.md section 9): g = max over the unit's tokens of the biased scores; keep the
`topk_group` groups with the largest sum of their top-2 g; the pool is the top-C experts of g inside them."""
from datetime import timedelta

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ebpo.model.routing import block_pool, block_route

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
