"""CPU tests: flex masks vs the dense masks of ebpo.model.masks; SDPA and FlexAttention vs a plain reference."""
import math

import pytest
import torch

from kernels.attention import attention, flex_block_mask, layout_length, mask_mod_for

masks = pytest.importorskip("ebpo.model.masks")


def dense_reference(kind, L, K, n):
    if kind == "block_causal":
        return masks.block_causal_mask(L, K)
    if kind == "noisy_clean":
        return masks.noisy_clean_mask(L, K)
    return masks.packed_noisy_clean_mask(L, K, n)


def plain_attention(q, k, v, keep, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.double() @ k.double().transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ v.double()).to(q.dtype)


CASES = [("block_causal", 40, 8, 1), ("noisy_clean", 24, 8, 1), ("packed", 16, 4, 3), ("packed", 20, 8, 2)]


@pytest.mark.parametrize("kind,L,K,n", CASES)
def test_mask_mod_equals_dense_mask(kind, L, K, n):
    T = layout_length(kind, L, n)
    i = torch.arange(T)
    dense = mask_mod_for(kind, L, K, n)(0, 0, i[:, None], i[None, :])
    assert torch.equal(dense, dense_reference(kind, L, K, n))


def test_sdpa_with_keep_mask_and_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8)
    keep = masks.noisy_clean_mask(12, 4)
    torch.testing.assert_close(attention(q, k, v, keep), plain_attention(q, k, v, keep), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention(q, k, v, keep[None, None].expand(2, 1, 24, 24), scale=0.3),
                               plain_attention(q, k, v, keep, scale=0.3), rtol=1e-5, atol=1e-5)


def test_decode_against_prefix_needs_no_mask():
    """Active block (last K queries) vs prefix + block, no mask == the block-causal full forward rows."""
    torch.manual_seed(1)
    K, L = 4, 12
    q, k, v = torch.randn(1, 2, L, 8), torch.randn(1, 1, L, 8), torch.randn(1, 1, L, 8)
    full = attention(q, k, v, masks.block_causal_mask(L, K))
    active = attention(q[:, :, -K:], k, v)  # keys: prefix (8) + block (4)
    torch.testing.assert_close(active, full[:, :, -K:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,L,K,n", [CASES[0], CASES[2]])
def test_flex_equals_sdpa(kind, L, K, n):
    torch.manual_seed(2)
    T = layout_length(kind, L, n)
    q, k, v = torch.randn(1, 4, T, 16), torch.randn(1, 2, T, 16), torch.randn(1, 2, T, 16)
    bm = flex_block_mask(kind, L, K, n, device="cpu")
    out = attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, attention(q, k, v, dense_reference(kind, L, K, n)), rtol=1e-5, atol=1e-5)


def test_errors():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="bool"):
        attention(q, q, q, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="unknown mask kind"):
        mask_mod_for("causal", 4, 2)
