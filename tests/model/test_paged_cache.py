"""`PagedKVCache` (ebpo/model/paged_cache.py) against `BlockKVCache`, the dense cache, as the reference: the same
random sequence of forwards (commits of random lengths), truncations and prefix copies gives the same prefix
keys/values on every valid position; the pages in use are exactly the distinct pages the rows read."""
import random

import pytest
import torch

from ebpo.model.cache import BlockKVCache
from ebpo.model.paged_cache import PagedKVCache

L, B, T, H, D, P = 2, 4, 24, 2, 3, 4


def _valid_prefix(cache, rows):
    view = cache.begin(rows)
    out = []
    for layer in range(L):
        k, v = cache.prefix(layer)
        out.append([(k[i, :cache.lengths[r]], v[i, :cache.lengths[r]]) for i, r in enumerate(rows)])
    return view.prefix_len, out


def _forward(cache, rows, Lq, values):
    cache.begin(rows)
    for layer in range(L):
        cache.stage(layer, values[layer][0], values[layer][1])


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_dense_cache(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dense = BlockKVCache(L, B, T, H, D)
    paged = PagedKVCache(L, B, T, H, D, page=P, initial_pages=1)
    for _ in range(40):
        op = rng.random()
        if op < 0.6:  # a forward over some rows, then a commit of random lengths
            rows = sorted(rng.sample(range(B), rng.randint(1, B)))
            Lq = rng.randint(1, 6)
            vals = [(torch.randn(len(rows), Lq, H, D, generator=g), torch.randn(len(rows), Lq, H, D, generator=g))
                    for _ in range(L)]
            n = [min(rng.randint(0, Lq), T - dense.lengths[r]) for r in rows]
            for c in (dense, paged):
                _forward(c, rows, Lq, vals)
                c.commit(n)
        elif op < 0.8:  # truncate one row
            r = rng.randrange(B)
            n = rng.randint(0, dense.lengths[r])
            for c in (dense, paged):
                c.truncate([r], [n])
        else:  # one row takes another's whole pages
            src, dst = rng.sample(range(B), 2)
            n = (dense.lengths[src] // P) * P
            for c in (dense, paged):
                c.copy_prefix(src, dst, n)
        assert paged.lengths == dense.lengths
        rows = list(range(B))
        (s1, a), (s2, b) = _valid_prefix(dense, rows), _valid_prefix(paged, rows)
        assert s1 == s2
        for la, lb in zip(a, b):
            for (k1, v1), (k2, v2) in zip(la, lb):
                assert torch.equal(k1, k2) and torch.equal(v1, v2)
        read = {p for r in range(B) for p in paged.tables[r]}
        assert paged.pages_in_use == len(read)  # nothing leaks, nothing is freed while read
        assert all(len(paged.tables[r]) == -(-paged.lengths[r] // P) for r in range(B))


def test_a_shared_prompt_is_held_once_and_copied_on_write():
    paged = PagedKVCache(L, B, T, H, D, page=P)
    vals = [(torch.arange(8 * H * D, dtype=torch.float32).reshape(1, 8, H, D),) * 2 for _ in range(L)]
    _forward(paged, [0], 8, vals)
    paged.commit(8)
    for r in (1, 2, 3):
        paged.copy_prefix(0, r, 8)
    assert paged.pages_in_use == 2 and paged.peak_pages == 2  # four rows of 8 tokens, two pages
    with pytest.raises(ValueError, match="whole number"):
        paged.copy_prefix(0, 1, 6)
    paged.truncate([1], [6])  # row 1 keeps its first two pages' references (6 tokens need 2 pages)
    new = [(torch.full((1, 2, H, D), -1.0),) * 2 for _ in range(L)]
    _forward(paged, [1], 2, new)
    paged.commit(2)  # writes positions 6, 7 of row 1: its second page is copied first
    assert paged.pages_in_use == 3
    _, out = _valid_prefix(paged, [0, 1])
    assert torch.equal(out[0][0][0], vals[0][0][0])  # row 0 still reads its own values
    assert torch.equal(out[0][1][0][6:], torch.full((2, H, D), -1.0))
    for r in range(B):
        paged.truncate([r], [0])
    assert paged.pages_in_use == 0


def _attend_reference(q, k, v, keep):
    """q (b, Lq, Hq, D), k, v (b, N, kv, D), keep (b, 1, Lq, N) -> (b, Lq, Hq, D): softmax attention in float64,
    query head h reading kv head h // (Hq / kv)."""
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    s = torch.einsum("blhd,bnhd->bhln", q.double(), kk) / q.shape[-1] ** 0.5
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhln,bnhd->blhd", torch.softmax(s, -1), vv)


def _cascade_output(cache, layer, q, keep):
    """What the model's attention computes from `cache.cascade` (grouped rows) and the plain prefix (the rest)."""
    from kernels.cascade import cascade_attention
    split = cache.cascade(layer, keep)
    k_new, v_new = cache._pending[layer]
    out = torch.zeros(q.shape, dtype=torch.float64)
    out[split.rows] = cascade_attention(q, split.groups, split.rest_k, split.rest_v, split.rest_keep).double()
    if split.plain.numel():
        p = split.plain
        out[p] = _attend_reference(q[p], torch.cat([split.plain_k, k_new[p]], 1), torch.cat([split.plain_v, v_new[p]], 1),
                                   keep[p])
    return split, out


@pytest.mark.parametrize("seed", range(8))
def test_cascade_split_gives_attention_over_each_rows_prefix(seed):
    """Rows that share pages (copies of a prompt, some diverged, one seeing only part of its prefix as an MBE
    window does, one with a padded query that sees no prefix) split into groups; grouped and plain rows together
    give exactly attention over every row's own gathered prefix and new keys."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    Hq, n_rows, pg = 4, 6, 4
    paged = PagedKVCache(L, n_rows, 48, H, D, page=pg, cascade_min_shared=0, cascade_ratio=0)
    vals = [(torch.randn(1, 12, H, D, generator=g), torch.randn(1, 12, H, D, generator=g))] * L
    _forward(paged, [0], 12, vals)
    paged.commit(12)
    for r in range(1, n_rows - 1):
        paged.copy_prefix(0, r, rng.choice([8, 12]))
    own = [(torch.randn(n_rows, 6, H, D, generator=g), torch.randn(n_rows, 6, H, D, generator=g))] * L
    _forward(paged, list(range(n_rows)), 6, own)
    paged.commit([rng.randint(0, 6) for _ in range(n_rows)])  # diverged tails; the last row holds its own keys only
    rows = rng.sample(range(n_rows), n_rows)
    Lq = 3
    view = paged.begin(rows)
    S = view.prefix_len
    k_new = torch.randn(n_rows, Lq, H, D, generator=g)
    v_new = torch.randn(n_rows, Lq, H, D, generator=g)
    paged.stage(0, k_new, v_new)
    q_start = [paged.lengths[r] for r in rows]
    q_start[rng.randrange(n_rows)] = 4 * rng.randint(0, 2)  # an MBE-like row that sees part of its prefix
    keep = torch.zeros(n_rows, 1, Lq, S + Lq, dtype=torch.bool)
    for i in range(n_rows):
        keep[i, 0, :, :q_start[i]] = True
        keep[i, 0, :, S:] = torch.rand(Lq, Lq, generator=g) < 0.5
        keep[i, 0, :, S:] |= torch.eye(Lq, dtype=torch.bool)
    padded = rng.randrange(n_rows)
    keep[padded, 0, -1, :S] = False  # a padding query: it sees itself only
    q = torch.randn(n_rows, Lq, Hq, D, generator=g)
    k_prev, v_prev = paged.prefix(0)
    want = _attend_reference(q, torch.cat([k_prev, k_new], 1), torch.cat([v_prev, v_new], 1), keep)
    split, got = _cascade_output(paged, 0, q, keep)
    assert split.rows.numel() + split.plain.numel() == n_rows
    assert sorted(split.rows.tolist() + split.plain.tolist()) == list(range(n_rows))
    assert padded not in split.rows.tolist() and len(split.groups) >= 1
    for rows_g, ks, _ in split.groups:  # a group's members really read the same first pages
        tables = {tuple(paged.tables[rows[i]][: -(-len(ks) // pg)]) for i in rows_g.tolist()}
        assert len(tables) == 1 and len(ks) >= pg
    tol = 16 * (D + S + Lq) * torch.finfo(torch.float32).eps
    assert torch.allclose(got, want, atol=tol, rtol=0), (got - want).abs().max()


def test_no_cascade_without_shared_pages():
    paged = PagedKVCache(L, 3, 24, H, D, page=P, cascade_min_shared=0, cascade_ratio=0)
    for r in range(3):
        _forward(paged, [r], 8, [(torch.randn(1, 8, H, D), torch.randn(1, 8, H, D))] * L)
        paged.commit(8)
    paged.begin([0, 1, 2])
    paged.stage(0, torch.randn(3, 2, H, D), torch.randn(3, 2, H, D))
    keep = torch.ones(3, 1, 2, 10, dtype=torch.bool)
    assert paged.cascade(0, keep) is None
    paged.copy_prefix(0, 2, 8)
    paged.begin([0, 1, 2])
    paged.stage(0, torch.randn(3, 2, H, D), torch.randn(3, 2, H, D))
    split = paged.cascade(0, keep)
    assert split.rows.tolist() == [0, 2] and split.plain.tolist() == [1] and len(split.groups[0][1]) == 8


def test_cascade_groups_only_rows_whose_shared_keys_dominate():
    """Defaults: a group needs 128 shared keys or more, and a row joins it only while its own keys (plus the new
    ones) are at most a quarter of them; the rest attend plainly."""
    paged = PagedKVCache(L, 4, 400, H, D, page=8)
    _forward(paged, [0], 128, [(torch.randn(1, 128, H, D), torch.randn(1, 128, H, D))] * L)
    paged.commit(128)
    for r in (1, 2, 3):
        paged.copy_prefix(0, r, 128)
    own = [(torch.randn(4, 40, H, D), torch.randn(4, 40, H, D))] * L
    _forward(paged, [0, 1, 2, 3], 40, own)
    paged.commit([0, 8, 24, 40])  # own keys 0, 8, 24, 40 (+ 2 new): 128 >= 4 x (own + 2) for 0, 8 and 24, not 40
    keep = torch.ones(4, 1, 2, paged.begin([0, 1, 2, 3]).prefix_len + 2, dtype=torch.bool)
    for i, n in enumerate(paged.lengths):
        keep[i, 0, :, n:-2] = False
    paged.stage(0, torch.randn(4, 2, H, D), torch.randn(4, 2, H, D))
    split = paged.cascade(0, keep)
    assert split.rows.tolist() == [0, 1, 2] and split.plain.tolist() == [3]
    assert split.rest_k.shape[1] == 24 + 2  # the longest grouped row's own keys, then the new ones
    small = PagedKVCache(L, 2, 64, H, D, page=8)
    _forward(small, [0], 64, [(torch.randn(1, 64, H, D), torch.randn(1, 64, H, D))] * L)
    small.commit(64)
    small.copy_prefix(0, 1, 64)
    small.begin([0, 1])
    small.stage(0, torch.randn(2, 2, H, D), torch.randn(2, 2, H, D))
    assert small.cascade(0, torch.ones(2, 1, 2, 66, dtype=torch.bool)) is None  # 64 shared keys: too few to gain
