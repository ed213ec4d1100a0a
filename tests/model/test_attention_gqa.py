"""Grouped-query attention against a plain per-head loop (query head h reads K/V head h // group)."""
import math

import torch

from ebpo.model.masks import block_causal_mask
from ebpo.model import tiny_config
from ebpo.model.modeling_llada2_moe import LLaDA2MoeAttention, apply_partial_rope, rope_cos_sin


def _reference(attn: LLaDA2MoeAttention, x, position_ids, keep):
    B, L, _ = x.shape
    H, KV, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.query_key_value(x).view(B, L, H + 2 * KV, D)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + KV], qkv[:, :, H + KV:]
    q, k = attn.query_layernorm(q), attn.key_layernorm(k)
    cos, sin = rope_cos_sin(position_ids, attn.rotary_dim, attn.rope_theta, q.dtype)
    q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    out = torch.zeros(B, L, H, D)
    for b in range(B):
        for h in range(H):
            g = h // (H // KV)
            for i in range(L):
                scores = torch.tensor([float(q[b, i, h] @ k[b, j, g]) / math.sqrt(D) if keep[i, j] else -math.inf
                                       for j in range(L)])
                out[b, i, h] = torch.softmax(scores, 0) @ v[b, :, g]
    return attn.dense(out.reshape(B, L, H * D))


def test_gqa_attention_matches_a_per_head_loop():
    cfg = tiny_config()
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # the grouped case is what is tested
    torch.manual_seed(0)
    attn = LLaDA2MoeAttention(cfg, 0).eval()
    B, L = 2, 11
    x = torch.randn(B, L, cfg.hidden_size)
    pos = torch.arange(L).expand(B, L)
    keep = block_causal_mask(L, 4)
    with torch.no_grad():
        got = attn(x, pos, keep[None, None])
        want = _reference(attn, x, pos, keep)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
