"""Block-causal attention (kernels.attention) on the CPU: flex masks vs the dense masks of ebpo.model.masks; SDPA and
FlexAttention vs a plain reference; block-sparse attention of the noisy/clean layout (no masked-out score computed)
against the dense masks, and the by-block cached composites against the dense-mask cached path and a per-block loop
(fp32)."""
import math

import pytest
import torch

from kernels.attention import attention, copy_block_attention, flex_block_mask, layout_length, mask_mod_for

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


def _packed_reference(q, k, v, copies, K):
    """Row (c, b) of the copy layout laid out as `[copy_0 .. copy_{C-1}]` of sequence b with the dense
    `packed_noisy_clean_mask` (the last copy is the clean one), then split back into rows."""
    CB, H, L, D = q.shape
    B = CB // copies

    def packed(t):  # (C*B, H, L, D) -> (B, H, C*L, D)
        return t.view(copies, B, t.shape[1], L, D).permute(1, 2, 0, 3, 4).reshape(B, t.shape[1], copies * L, D)

    keep = masks.packed_noisy_clean_mask(L, K, copies - 1) if copies > 1 else masks.block_causal_mask(L, K)
    out = attention(packed(q), packed(k), packed(v), keep)
    return out.view(B, H, copies, L, D).permute(2, 0, 1, 3, 4).reshape(CB, H, L, D)


@pytest.mark.parametrize("copies,B,L,K", [(3, 2, 16, 4), (1, 2, 12, 4), (4, 1, 10, 4), (2, 3, 8, 8)])
def test_copy_block_attention_equals_dense_packed_mask(copies, B, L, K):
    torch.manual_seed(copies * 7 + L)
    q = torch.randn(copies * B, 4, L, 8)
    k, v = torch.randn(copies * B, 2, L, 8), torch.randn(copies * B, 2, L, 8)
    torch.testing.assert_close(copy_block_attention(q, k, v, copies, K), _packed_reference(q, k, v, copies, K),
                               rtol=1e-5, atol=1e-5)


def test_copy_block_attention_after_a_cached_prefix_equals_the_whole_layout():
    """G blocks after S cached clean tokens == the last G blocks of the whole layout run at once."""
    torch.manual_seed(3)
    copies, B, K, S, G = 3, 2, 4, 8, 2
    L = S + G * K
    q = torch.randn(copies * B, 2, L, 8)
    k, v = torch.randn(copies * B, 1, L, 8), torch.randn(copies * B, 1, L, 8)
    clean = slice((copies - 1) * B, copies * B)
    k[:, :, :S], v[:, :, :S] = k[clean, :, :S].repeat(copies, 1, 1, 1), v[clean, :, :S].repeat(copies, 1, 1, 1)
    whole = copy_block_attention(q, k, v, copies, K)[:, :, S:]
    part = copy_block_attention(q[:, :, S:], k[:, :, S:], v[:, :, S:], copies, K, k[clean, :, :S], v[clean, :, :S])
    torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-5)


def test_copy_block_attention_is_differentiable():
    torch.manual_seed(4)
    q = torch.randn(4, 2, 8, 8, requires_grad=True)
    k, v = torch.randn(4, 2, 8, 8, requires_grad=True), torch.randn(4, 2, 8, 8, requires_grad=True)
    (copy_block_attention(q, k, v, 2, 4) ** 2).sum().backward()
    g = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (_packed_reference(q, k, v, 2, 4) ** 2).sum().backward()
    for a, t in zip(g, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)


def _model(K=4):
    from ebpo.model import LLaDA2MoeModelLM, tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                            moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                            block_size=K, initializer_range=0.2)).eval()


def _loop(model, ids, noise, mask_id):
    from ebpo.core.likelihood import composite_logprobs_blockwise

    return torch.stack([composite_logprobs_blockwise(model, ids, noise, n, mask_id) for n in range(noise.n_draws)], 1)


@pytest.mark.parametrize("L,prompt,group_tokens", [(24, 2, 1), (24, 9, 1), (22, 5, 10_000), (24, 13, 200), (9, 1, 1)])
def test_by_block_cached_composites_equal_dense_cached_and_loop(L, prompt, group_tokens):
    """Leading prompt-only blocks, a partial last block, one or several blocks per forward, B = 1 and B = 3."""
    from ebpo.core.likelihood import composite_logprobs_cached, draw_noise

    K = 4
    model = _model(K)
    mask_id = model.config.mask_token_id
    for B in (1, 3):
        g = torch.Generator().manual_seed(B + L)
        ids = torch.randint(3, 128, (B, L), generator=g)
        resp = torch.zeros(B, L, dtype=torch.bool)
        resp[:, prompt:] = True
        noise = draw_noise(resp, K, 3, 0.1, 1.0, g)
        with torch.no_grad():
            fast, blocks = composite_logprobs_cached(model, ids, noise, range(3), mask_id, return_blocks=True,
                                                     group_tokens=group_tokens)
            dense, dense_blocks = composite_logprobs_cached(model, ids, noise, range(3), mask_id, return_blocks=True,
                                                            by_block=False)
            loop = _loop(model, ids, noise, mask_id)
        torch.testing.assert_close(fast, dense, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(blocks, dense_blocks, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(fast, loop, rtol=1e-5, atol=1e-4)


def test_copy_block_layout_with_a_cache_needs_tiled_rows():
    from ebpo.model import BlockKVCache
    from ebpo.model.masks import CopyBlockLayout

    model = _model(4)
    cache = BlockKVCache.for_model(model.config, 2, 16)
    with torch.no_grad():
        model(torch.randint(3, 100, (2, 4)), cache=cache, return_logits=False)
        cache.commit(4)
        with pytest.raises(ValueError, match="list\\(range\\(B\\)\\) \\* copies"):
            model(torch.randint(3, 100, (4, 4)), attention_mask=CopyBlockLayout(2, 4), position_ids=torch.arange(4, 8),
                  cache=cache, cache_rows=[0, 1, 1, 0], return_logits=False)
