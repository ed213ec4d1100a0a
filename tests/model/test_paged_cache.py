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
