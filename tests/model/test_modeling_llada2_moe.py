"""The LLaDA2.x MoE block-diffusion transformer (ebpo.model.modeling_llada2_moe): block causality, the noisy/clean
layout, routing against brute force, grouped experts against a dense plain loop, grouped-query attention against a
plain per-head loop (query head h reads K/V head h // group), padding, gradient checkpointing, and Hugging Face round
trips (save_pretrained, the auto classes, the released key names)."""
import itertools
import math

import torch
import torch.nn.functional as F

from ebpo.model import LLaDA2MoeConfig, LLaDA2MoeModelLM, enable_activation_checkpointing, tiny_config
from ebpo.model.masks import block_causal_mask, noisy_clean_mask, noisy_clean_position_ids
from ebpo.model.modeling_llada2_moe import LLaDA2MoeAttention, apply_partial_rope, rope_cos_sin


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return LLaDA2MoeModelLM(tiny_config(**overrides)).eval()


def rounding_scale(model, out) -> float:
    """Scale of the rounding error of fp32 logits, from the computation: each layer's sums (over the hidden
    size H: attention and MLP projections, residual adds) err by up to LAMBDA * sqrt(H) * u of the magnitude of
    their terms, and the layers add up; the last sum, the LM head, has terms of magnitude |h| |W|. (u: fp32
    unit roundoff; LAMBDA = 8: the probabilistic rounding bound of Higham & Mary, missed with probability
    ~3e-14.) What changes between two fp32 evaluations of the same logits (a regrouped MoE GEMM, another
    kernel path) stays within it; a real dependence on another block shows up orders of magnitude above."""
    cfg, u, lam = model.config, torch.finfo(torch.float32).eps / 2, 8.0
    terms = (out.last_hidden_state.abs() @ model.lm_head.weight.abs().t()).max().item()
    return lam * cfg.hidden_size ** 0.5 * u * (cfg.num_hidden_layers + 1) * terms


def test_changing_a_block_leaves_earlier_blocks_untouched():
    model = make_model()
    K, L = model.config.block_size, 4 * model.config.block_size
    x = torch.randint(8, 100, (1, L))
    ref = model(x)
    base, tol = ref.logits, 2 * rounding_scale(model, ref)  # two evaluations: twice the rounding of one
    for b in range(1, 4):
        y = x.clone()
        y[0, b * K:(b + 1) * K] = torch.randint(8, 100, (K,))
        out = model(y).logits
        # the later block regroups the MoE GEMMs' rows: rounding may differ, nothing else
        torch.testing.assert_close(out[0, : b * K], base[0, : b * K], atol=tol, rtol=0)
        assert not torch.allclose(out[0, b * K:(b + 1) * K], base[0, b * K:(b + 1) * K])


def test_noisy_clean_layout_clean_half_equals_plain_forward():
    model = make_model()
    K, L = model.config.block_size, 3 * model.config.block_size
    clean = torch.randint(8, 100, (2, L))
    noisy = clean.masked_fill(torch.rand(2, L) < 0.5, model.config.mask_token_id)
    out = model(torch.cat([noisy, clean], 1), attention_mask=noisy_clean_mask(L, K)[None, None],
                position_ids=noisy_clean_position_ids(L)).logits
    torch.testing.assert_close(out[:, L:], model(clean).logits, atol=1e-5, rtol=1e-4)
    # Noisy block b equals a forward of [clean blocks < b, noisy block b] under a plain block-causal mask.
    for b in range(3):
        ctx = torch.cat([clean[:, : b * K], noisy[:, b * K:(b + 1) * K]], 1)
        ref = model(ctx).logits[:, b * K:]
        torch.testing.assert_close(out[:, b * K:(b + 1) * K], ref, atol=1e-5, rtol=1e-4)


def brute_force_route(x, weight, bias, n_group, topk_group, top_k, scale):
    """Plain per-token loops, written independently of the model."""
    T, E = x.shape[0], weight.shape[0]
    per = E // n_group
    idx_out, w_out = [], []
    for t in range(T):
        s = [1 / (1 + float(torch.exp(-(x[t].double() @ weight[e].double())))) for e in range(E)]
        c = [s[e] + float(bias[e]) for e in range(E)]
        gscore = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[:top_k]
        total = sum(s[e] for e in chosen)
        idx_out.append(sorted(chosen))
        w_out.append({e: s[e] / total * scale for e in chosen})
    return idx_out, w_out


def test_routing_matches_brute_force():
    torch.manual_seed(1)
    cfg = tiny_config(num_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3)
    gate = LLaDA2MoeModelLM(cfg).model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.normal_()
        gate.expert_bias.copy_(torch.randn(12) * 0.5)  # large bias: selection must differ from weights
    x = torch.randn(40, cfg.hidden_size) * 0.3
    idx, w = gate(x)
    ref_idx, ref_w = brute_force_route(x, gate.weight.detach(), gate.expert_bias, 4, 2, 3, cfg.routed_scaling_factor)
    for t in range(40):
        got = sorted(idx[t].tolist())
        assert got == ref_idx[t]
        for j, e in enumerate(idx[t].tolist()):
            assert abs(float(w[t, j]) - ref_w[t][e]) < 1e-5


def test_experts_grouped_equals_dense_and_plain_loop_with_grads():
    torch.manual_seed(2)
    cfg = tiny_config()
    experts = LLaDA2MoeModelLM(cfg).model.layers[1].mlp.experts
    x = torch.randn(30, cfg.hidden_size, requires_grad=True)
    idx = torch.stack([torch.randperm(cfg.num_experts)[:2] for _ in range(30)])
    w = torch.rand(30, 2)
    outs, grads = [], []
    for impl in ("grouped", "dense", "loop"):
        experts.zero_grad()
        x.grad = None
        if impl == "loop":
            out = torch.zeros_like(x)
            rows = []
            for t in range(30):
                acc = 0
                for j in range(2):
                    e = int(idx[t, j])
                    h = F.silu(experts.gate_proj[e] @ x[t]) * (experts.up_proj[e] @ x[t])
                    acc = acc + w[t, j] * (experts.down_proj[e] @ h)
                rows.append(acc)
            out = torch.stack(rows)
        else:
            experts.impl = impl
            out = experts(x, idx, w)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append((x.grad.clone(), experts.gate_proj.grad.clone(), experts.down_proj.grad.clone()))
    for o, g in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-4)
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_save_pretrained_round_trip_and_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = make_model()
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "llada2_moe"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LLaDA2MoeModelLM
    x = torch.randint(8, 100, (2, 19))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)


def released_key_names(cfg: LLaDA2MoeConfig) -> set[str]:
    """Weight names of a released LLaDA2 checkpoint (docs/background.md section 1), written out by hand."""
    keys = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        keys |= {p + f"attention.{m}.weight" for m in ("query_key_value", "query_layernorm", "key_layernorm", "dense")}
        if n < cfg.first_k_dense_replace:
            keys |= {p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
        else:
            keys |= {p + "mlp.gate.weight", p + "mlp.gate.expert_bias"}
            keys |= {p + f"mlp.experts.{e}.{m}.weight" for e, m in
                     itertools.product(range(cfg.num_experts), ("gate_proj", "up_proj", "down_proj"))}
            keys |= {p + f"mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    return keys


def test_state_dict_with_released_key_names_loads_exactly(tmp_path):
    from safetensors.torch import load_file

    model = make_model()
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert set(on_disk) == released_key_names(model.config)
    fresh = make_model(seed=5)
    result = fresh.load_state_dict(on_disk, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randint(8, 100, (1, 16))
    torch.testing.assert_close(fresh(x).logits, model(x).logits, atol=0, rtol=0)


def test_padding_mask_matches_unpadded_forward():
    model = make_model()
    x = torch.randint(8, 100, (1, 11))
    padded = torch.cat([x, torch.full((1, 5), model.config.pad_token_id)], 1)
    pad_mask = torch.cat([torch.ones(1, 11), torch.zeros(1, 5)], 1).long()
    torch.testing.assert_close(model(padded, attention_mask=pad_mask).logits[:, :11], model(x).logits, atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_same_gradients():
    model = make_model().train()
    x = torch.randint(8, 100, (2, 16))
    model(x).logits.logsumexp(-1).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    enable_activation_checkpointing(model)
    model(x).logits.logsumexp(-1).sum().backward()
    for p, g in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


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
