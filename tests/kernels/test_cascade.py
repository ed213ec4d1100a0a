"""kernels/cascade.py: attention over a shared prefix scored once per group, merged by log-sum-exp, against plain
softmax attention over each row's concatenated keys written out with explicit per-head loops."""
import math

import pytest
import torch

import kernels.cascade
from kernels.cascade import cascade_attention, group_prefix_part, merge, rows_part


@pytest.fixture(params=["fused", "plain"], autouse=True)
def path(request, monkeypatch):
    """Every test runs twice: on CPU's fused attention (where torch has it) and on the plain matrix products that
    other devices take."""
    if request.param == "fused" and kernels.cascade._FUSED_CPU is None:
        pytest.skip("this torch has no fused CPU attention op")
    if request.param == "plain":
        monkeypatch.setattr(kernels.cascade, "_FUSED_CPU", None)
    return request.param


def _reference(q, k, v, keep):
    """q (L, H, D), k, v (N, Hkv, D), keep (L, N) bool -> (L, H, D): softmax(q k^T / sqrt D) v per head, float64."""
    L, H, D = q.shape
    rep = H // k.shape[1]
    out = torch.zeros(L, H, D, dtype=torch.float64)
    for h in range(H):
        kh, vh = k[:, h // rep].double(), v[:, h // rep].double()
        for i in range(L):
            s = (kh @ q[i, h].double()) / math.sqrt(D)
            s[~keep[i]] = -math.inf
            out[i, h] = torch.softmax(s, 0) @ vh
    return out


def _tol(D, N):
    # float32 scores and sums over N keys of D-term products of O(1) values
    return 8 * (D + N) * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("heads,kv,dtype", [(4, 2, torch.float32), (4, 4, torch.float32), (6, 1, torch.float32),
                                            (4, 2, torch.bfloat16)])
def test_cascade_matches_attention_over_the_concatenated_keys(heads, kv, dtype):
    g = torch.Generator().manual_seed(0)
    D, L = 16, 5
    shared_lens = [12, 7, 9]  # three groups, rows interleaved
    members = [[0, 3, 4], [1, 2], [6, 5]]
    B = 7
    q = torch.randn(B, L, heads, D, generator=g)
    shared = [(torch.randn(n, kv, D, generator=g), torch.randn(n, kv, D, generator=g)) for n in shared_lens]
    R = 6  # each row's own keys after its shared ones (some masked), then its L new keys
    own_k = torch.randn(B, R + L, kv, D, generator=g)
    own_v = torch.randn(B, R + L, kv, D, generator=g)
    own_keep = torch.rand(B, 1, L, R + L, generator=g) < 0.6
    own_keep[:, 0, :, R:] |= torch.eye(L, dtype=torch.bool)  # every query keeps its own key
    if dtype != torch.float32:  # the reference reads the values the kernel was given
        q, own_k, own_v = q.to(dtype).float(), own_k.to(dtype).float(), own_v.to(dtype).float()
        shared = [(ks.to(dtype).float(), vs.to(dtype).float()) for ks, vs in shared]
    groups = [(torch.tensor(m), ks.to(dtype), vs.to(dtype)) for m, (ks, vs) in zip(members, shared)]
    order = [r for m in members for r in m]
    out = cascade_attention(q.to(dtype), groups, own_k[order].to(dtype), own_v[order].to(dtype), own_keep[order])
    assert out.shape == (B, L, heads, D) and out.dtype == dtype
    # computed in float32 whatever the input; a bf16 output is one rounding of it (8 bits of mantissa)
    tol_out = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    for j, r in enumerate(order):
        gi = next(i for i, m in enumerate(members) if r in m)
        ks, vs = shared[gi]
        k = torch.cat([ks, own_k[r]])
        v = torch.cat([vs, own_v[r]])
        keep = torch.cat([torch.ones(L, len(ks), dtype=torch.bool), own_keep[r, 0]], 1)
        want = _reference(q[r], k, v, keep)
        err = (out[j].double() - want).abs()
        assert (err <= _tol(D, len(k)) + tol_out * want.abs()).all(), (r, err.max())


def test_rows_part_is_masked_softmax_attention_and_merge_of_halves_is_the_whole():
    g = torch.Generator().manual_seed(1)
    b, L, H, kv, D, N = 3, 4, 4, 2, 8, 10
    q = torch.randn(b, L, H, D, generator=g)
    k, v = torch.randn(b, N, kv, D, generator=g), torch.randn(b, N, kv, D, generator=g)
    keep = torch.rand(b, 1, L, N, generator=g) < 0.7
    keep[..., 0] = True
    keep[..., 5] = True
    out, lse = rows_part(q, k, v, keep)
    for r in range(b):
        assert torch.allclose(out[r].double(), _reference(q[r], k[r], v[r], keep[r, 0]), atol=_tol(D, N), rtol=0)
        for h in range(H):  # the log-sum-exp of the kept scores, which the merge weighs the two parts by
            s = (q[r, :, h].double() @ k[r, :, h // (H // kv)].double().T) / math.sqrt(D)
            want = torch.logsumexp(s.masked_fill(~keep[r, 0], -math.inf), dim=1)
            assert torch.allclose(lse[r, :, h].double(), want, atol=_tol(D, N), rtol=0), (r, h)
    # split the keys in two disjoint halves: merging their partial attentions gives the whole
    a = rows_part(q, k[:, :5], v[:, :5], keep[..., :5])
    c = rows_part(q, k[:, 5:], v[:, 5:], keep[..., 5:])
    assert torch.allclose(merge(a[0], a[1], c[0], c[1]), out, atol=_tol(D, N), rtol=0)
    assert torch.allclose(torch.logaddexp(a[1], c[1]), lse, atol=_tol(D, N), rtol=0)


def test_no_query_rows_give_empty_outputs():
    """Zero rows (no queries) is a valid, empty input on both paths; the fused CPU op alone would stop the process."""
    q = torch.zeros(0, 3, 4, 8)
    k, v = torch.randn(0, 5, 2, 8), torch.randn(0, 5, 2, 8)
    out, lse = rows_part(q, k, v, torch.ones(0, 1, 3, 5, dtype=torch.bool))
    assert out.shape == (0, 3, 4, 8) and lse.shape == (0, 3, 4)
    out, lse = group_prefix_part(q, torch.randn(5, 2, 8), torch.randn(5, 2, 8), 8 ** -0.5)
    assert out.shape == (0, 3, 4, 8) and lse.shape == (0, 3, 4)
