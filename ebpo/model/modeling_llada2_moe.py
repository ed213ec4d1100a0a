"""LLaDA2.x MoE block-diffusion transformer (`model_type = "llada2_moe"`).

Architecture and weight names follow docs/background.md section 1 exactly, so the `state_dict` of a released
LLaDA2.1 checkpoint loads into `LLaDA2MoeModelLM` with no missing or unexpected keys:

    x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))      (pre-norm residual)
    Attn: fused `query_key_value`, per-head RMSNorm on q and k, NeoX RoPE on the first
          `partial_rotary_factor * head_dim` dims, `dense` output; mask = boolean keep-mask.
    MLP:  layer < first_k_dense_replace: dense SwiGLU; else MoE with sigmoid, group-limited routing,
          `expert_bias` for selection only, routed scaling, shared experts.
    logits = lm_head(norm(x)) in fp32; position i predicts token i (no shift).

Routed experts are stored stacked (one (E, out, in) parameter per projection, state-dict key
`mlp.experts.{gate,up,down}_proj`) so they run as one grouped GEMM without a per-expert Python loop.
Released checkpoints name them per expert (`mlp.experts.{e}.{proj}.weight`): `load_state_dict` accepts
those through a load pre-hook, and `save_pretrained` / `from_pretrained` translate both ways through
a weight converter registered with transformers, so files on disk always carry the released names.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from kernels.attention import copy_block_attention
from kernels.cascade import cascade_attention

from ebpo.model.masks import CopyBlockLayout, padding_to_block_causal, block_causal_mask
from ebpo.model.cache import BlockKVCache, StaticKVCache
from ebpo.model.configuration_llada2_moe import LLaDA2MoeConfig
from ebpo.model.routing import block_route, block_routing_active, routing_units


class LLaDA2MoeRMSNorm(nn.Module):
    """RMSNorm computed in fp32 over the last dim, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype):
    """cos, sin of shape (B, L, rotary_dim) for NeoX rotary embedding at absolute `position_ids` (B, L).

    Computed from the config at every call rather than kept in a buffer: a non-persistent `inv_freq`
    buffer comes back as garbage after transformers 5 meta-device loading (docs/background.md section 7).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32) / rotary_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # (B, L, rot/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first cos.shape[-1] dims of x (B, L, heads, head_dim); the rest passes through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class LLaDA2MoeAttention(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.rope_theta = config.rope_theta
        self.query_key_value = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.use_qkv_bias)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = LLaDA2MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = LLaDA2MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, keep_mask: torch.Tensor | None,
                cache: BlockKVCache | None = None) -> torch.Tensor:
        """x (B, L, hidden), position_ids (B, L), keep_mask bool (B|1, 1, L, S+L) or None (full)."""
        B, L, _ = x.shape
        qkv = self.query_key_value(x).view(B, L, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        cos, sin = rope_cos_sin(position_ids, self.rotary_dim, self.rope_theta, q.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if isinstance(keep_mask, CopyBlockLayout):
            return self._copy_block(q, k, v, keep_mask, cache)
        if isinstance(cache, StaticKVCache):  # fixed shapes: write in place, attend the whole buffer by mask
            k, v = cache.write(self.layer_idx, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
            cache = None
        if cache is not None:
            cache.stage(self.layer_idx, k, v)
            split = cache.cascade(self.layer_idx, keep_mask)
            if split is not None:  # rows reading the same cached pages: their shared keys are scored once
                return self.dense(self._cascade(q, k, v, keep_mask, split).reshape(B, L, -1))
            k_prev, v_prev = cache.prefix(self.layer_idx)
            k = torch.cat([k_prev.to(k.dtype), k], dim=1)
            v = torch.cat([v_prev.to(v.dtype), v], dim=1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, len, D)
        # The one conversion point of the boolean keep-mask: SDPA takes bool with True = attend.
        # enable_gqa lets each group of query heads read its shared K/V head in place instead of
        # repeating K and V (over the whole cached prefix when decoding) num_heads / num_kv_heads times.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep_mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.dense(out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))

    def _cascade(self, q, k, v, keep: torch.Tensor, split) -> torch.Tensor:
        """q (B, L, heads, D), k, v (B, L, kv_heads, D) after RoPE -> (B, L, heads, D): the grouped rows of `split`
        (a `PagedKVCache.cascade`) by `kernels.cascade.cascade_attention`, the others as usual."""
        out = q.new_empty(q.shape)
        out[split.rows] = cascade_attention(q, split.groups, split.rest_k, split.rest_v, split.rest_keep)
        if split.plain.numel():
            p = split.plain
            kk = torch.cat([split.plain_k.to(k.dtype), k[p]], dim=1).transpose(1, 2)
            vv = torch.cat([split.plain_v.to(v.dtype), v[p]], dim=1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[p].transpose(1, 2), kk, vv, attn_mask=keep[p],
                                               enable_gqa=self.num_kv_heads != self.num_heads)
            out[p] = o.transpose(1, 2)
        return out

    def _copy_block(self, q, k, v, layout: CopyBlockLayout, cache: BlockKVCache | None) -> torch.Tensor:
        """Attention of a `CopyBlockLayout` input (see ebpo.model.masks): block by block, no mask."""
        B, L = q.shape[:2]
        k_pre = v_pre = None
        if cache is not None:
            cache.stage(self.layer_idx, k, v)
            if cache.view_prefix_len() > 0:
                shared = cache.shared_prefix(self.layer_idx)
                if shared is None or shared[2] != layout.copies:
                    raise ValueError("CopyBlockLayout with a KV cache needs cache_rows = list(range(B)) * copies "
                                     "and the same committed length in every row")
                k_pre, v_pre = shared[0].to(k.dtype).transpose(1, 2), shared[1].to(v.dtype).transpose(1, 2)
        out = copy_block_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout.copies,
                                   layout.block_size, k_pre, v_pre)
        return self.dense(out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim))


class LLaDA2MoeMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2MoeGate(nn.Module):
    """Sigmoid router with group-limited top-k; `expert_bias` shifts selection only (aux-loss free).
    With `block_routing_capacity` C in (0, E), each routing unit (diffusion block) first admits C experts and
    its tokens choose inside them (`ebpo.model.routing.block_route`)."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.block_routing_capacity = config.block_routing_capacity
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, units: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden), units (T,) long routing-unit ids (needed with block routing on)
        -> (topk_idx (T, k) long, topk_weight (T, k) fp32)."""
        return self.route(x, units)[:2]

    def route(self, x: torch.Tensor, units: torch.Tensor | None = None):
        """`forward`'s outputs plus the admitted pool: (T, E) bool with block routing on, else None."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        if block_routing_active(self.block_routing_capacity, scores.shape[1]):
            if units is None:
                raise ValueError("block routing (block_routing_capacity > 0) needs the tokens' routing units")
            topk_idx, pool = block_route(scores, self.expert_bias, units, self.block_routing_capacity, self.top_k,
                                         self.n_group, self.topk_group)
            return (*self._weights(scores, topk_idx), pool)
        choice = scores + self.expert_bias.float()
        T, E = choice.shape
        grouped = choice.view(T, self.n_group, E // self.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (T, n_group)
        keep_groups = group_score.topk(self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep_groups, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(T, E)
        topk_idx = choice.topk(self.top_k, dim=-1).indices
        return (*self._weights(scores, topk_idx), None)

    def _weights(self, scores, topk_idx):
        """(topk_idx, weights (T, k) fp32): the chosen experts' unbiased scores, normalised, scaled."""
        topk_weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped GEMM rejects expanded grads)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class LLaDA2MoeExperts(nn.Module):
    """All routed experts of one layer, stacked: gate/up (E, F, H), down (E, H, F).

    `moe_impl`:
      - "grouped": sort token-expert assignments by expert and run one grouped GEMM per projection
        (`torch._grouped_mm`, offsets on device: no host sync, no per-expert loop);
      - "dense": every expert on every token, combined with a (T, E) routing matrix. Exact and fully
        batched but E/k times the routed FLOPs: a fallback for tiny models;
      - "auto": grouped where `torch._grouped_mm` exists, else dense.
    """

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        E, H, Fd = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = E
        self.gate_proj = nn.Parameter(torch.empty(E, Fd, H))
        self.up_proj = nn.Parameter(torch.empty(E, Fd, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, Fd))
        impl = config.moe_impl
        if impl == "auto":
            impl = "grouped" if hasattr(torch, "_grouped_mm") else "dense"
        self.impl = impl
        self._register_load_state_dict_pre_hook(_experts_load_pre_hook, with_module=True)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                pool: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, H), topk_idx (T, k), topk_weight (T, k) -> (T, H) = sum_j w_j * expert_{idx_j}(x).

        pool: None, or (T, E) bool, each token's admitted experts (block routing). Without grad and outside
        compilation (decoding), the GEMMs then run over the experts admitted in this forward only: their
        weights are gathered once and the expert ids renumbered, so the work and the weights touched scale
        with the P <= units * C admitted experts instead of E."""
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        if pool is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            admitted = pool.any(0).nonzero().squeeze(1)  # (P,) sorted; one host sync
            local = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
            local[admitted] = torch.arange(admitted.numel(), device=x.device)
            topk_idx = local[topk_idx]
            weights = tuple(w.index_select(0, admitted) for w in weights)
        if self.impl == "dense":
            return self._forward_dense(x, topk_idx, topk_weight, *weights)
        return self._forward_grouped(x, topk_idx, topk_weight, *weights)

    def _forward_dense(self, x, topk_idx, topk_weight, gate_proj, up_proj, down_proj):
        T = x.shape[0]
        route = torch.zeros(T, gate_proj.shape[0], dtype=x.dtype, device=x.device)
        route.scatter_add_(1, topk_idx, topk_weight.to(x.dtype))
        h = F.silu(torch.einsum("th,efh->tef", x, gate_proj)) * torch.einsum("th,efh->tef", x, up_proj)
        h = h * route[..., None]
        return torch.einsum("tef,ehf->th", h, down_proj)

    def _forward_grouped(self, x, topk_idx, topk_weight, gate_proj, up_proj, down_proj):
        T, k = topk_idx.shape
        flat_expert = topk_idx.reshape(-1)
        order = flat_expert.argsort(stable=True)
        token_of = order // k
        xs = x[token_of]  # (T*k, H) grouped by expert
        # counts per expert with a fixed output shape (bincount's depends on the data: no graph capture)
        counts = torch.zeros(gate_proj.shape[0], dtype=torch.long, device=x.device).index_add_(
            0, flat_expert, torch.ones_like(flat_expert))
        offs = counts.cumsum(0).to(torch.int32)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            # traced as one opaque op: `_grouped_mm`'s meta function accepts only bf16 (its CUDA kernel's rule)
            # while its CPU kernel runs fp32; same kernel, same numbers as eager
            y = torch.ops.ebpo.grouped_swiglu(xs, offs, gate_proj, up_proj, down_proj)
        else:
            gm = torch._grouped_mm
            g = gm(xs, gate_proj.transpose(1, 2), offs=offs)
            u = gm(xs, up_proj.transpose(1, 2), offs=offs)
            h = _ContiguousGrad.apply(F.silu(g) * u)
            y = _ContiguousGrad.apply(gm(h, down_proj.transpose(1, 2), offs=offs))
        w = topk_weight.reshape(-1)[order].to(y.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, y * w[:, None])
        return out


@torch.library.custom_op("ebpo::grouped_swiglu", mutates_args=())
def _grouped_swiglu(xs: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """Routed experts' SwiGLU on rows grouped by expert (offs: end of each expert's rows), no grad."""
    gm = torch._grouped_mm
    h = F.silu(gm(xs, gate.transpose(1, 2), offs=offs)) * gm(xs, up.transpose(1, 2), offs=offs)
    return gm(h.contiguous(), down.transpose(1, 2), offs=offs).contiguous()


@_grouped_swiglu.register_fake
def _(xs, offs, gate, up, down):
    return xs.new_empty(xs.shape[0], down.shape[1])


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _experts_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                           unexpected_keys, error_msgs):
    """Accept per-expert names (released checkpoints) by stacking them into the module's parameters."""
    for proj in _EXPERT_PROJS:
        keys = [f"{prefix}{e}.{proj}.weight" for e in range(module.num_experts)]
        present = [k in state_dict for k in keys]
        if all(present):
            state_dict[prefix + proj] = torch.stack([state_dict.pop(k) for k in keys])
        elif any(present):
            missing = [k for k, p in zip(keys, present) if not p]
            error_msgs.append(f"incomplete experts for {prefix}{proj}: missing {missing[:3]}...")


class LLaDA2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.gate = LLaDA2MoeGate(config)
        self.experts = LLaDA2MoeExperts(config)
        self.shared_experts = (
            LLaDA2MoeMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor, units: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, hidden), units (B, L) routing-unit ids (`ebpo.model.routing.routing_units`) -> (B, L, hidden)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        topk_idx, topk_weight, pool = self.gate.route(flat, None if units is None else units.reshape(-1))
        # the pool only with block routing on: per-token routing calls the experts exactly as before
        # (other experts modules, e.g. kernels.fp8.FP8Experts, take the same three arguments)
        out = (self.experts(flat, topk_idx, topk_weight) if pool is None
               else self.experts(flat, topk_idx, topk_weight, pool=pool))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class LLaDA2MoeDecoderLayer(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        self.post_attention_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = LLaDA2MoeMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = LLaDA2MoeSparseMoeBlock(config)

    def forward(self, x, position_ids, keep_mask, cache=None, units=None, token_mask=None):
        """units (B, L): routing units of the tokens, used by a block-routed MoE layer (dense layers ignore it).
        token_mask (B, L) bool: only these tokens go through the MLP (padding slots of a decode layout get a
        zero update): the MLP is per token, so the real tokens' values are the same, without the padding's cost."""
        x = x + self.attention(self.input_layernorm(x), position_ids, keep_mask, cache)
        h = self.post_attention_layernorm(x)
        if token_mask is None:
            return x + self._mlp(h, units)
        u = None
        if units is not None:  # renumbered 0..U'-1 over the kept tokens (block_pool sizes its table by token count)
            u = units[token_mask]
            u = torch.cat([u.new_zeros(1), (u[1:] != u[:-1]).long().cumsum(0)])[: u.numel()]
        packed = self._mlp(h[token_mask][None], None if u is None else u[None])[0]
        return x + torch.zeros_like(h).index_put_((token_mask,), packed)

    def _mlp(self, h, units):
        return self.mlp(h, units) if isinstance(self.mlp, LLaDA2MoeSparseMoeBlock) else self.mlp(h)


@dataclass
class LLaDA2MoeOutput(ModelOutput):
    """`logits` (B, L, V) fp32 (None when `return_logits=False`); `last_hidden_state` (B, L, hidden);
    `cache` the `BlockKVCache` passed in, if any.

    The field is `cache`, the name transformers 5.24 gave every output's cache (it used to be
    `past_key_values`); transformers >= 5.24 still answers `out.past_key_values` with a deprecation warning.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: BlockKVCache | None = None


class LLaDA2MoePreTrainedModel(PreTrainedModel):
    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_sdpa = True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with the weight files readable like the other files: transformers
        5 writes them through a private temporary file (mode 0600), which breaks a shared model folder."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        mode = 0o666 & ~_current_umask()
        for path in Path(save_directory).glob("*.safetensors"):
            path.chmod(mode)
        return out

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, LLaDA2MoeRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, LLaDA2MoeGate):
            module.weight.normal_(0.0, std)
            module.expert_bias.zero_()
        elif isinstance(module, LLaDA2MoeExperts):
            for p in (module.gate_proj, module.up_proj, module.down_proj):
                p.normal_(0.0, std)


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, cache_rows=None, token_mask=None, **kwargs) -> torch.Tensor:
        """Returns the final-normed hidden states (B, L, hidden). See LLaDA2MoeModelLM.forward."""
        cache = _cache_argument(cache, kwargs)
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        if position_ids is None:
            start = 0
            if isinstance(cache, BlockKVCache):
                start = cache.lengths[0] if cache.batch_size else 0
            position_ids = torch.arange(start, start + L, device=x.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, L)
        keep = self._keep_mask(attention_mask, B, L, x.device, cache, cache_rows)
        # the one place where block membership is derived from the layout (ebpo.model.routing): every
        # MoE layer routes per unit when block routing is on
        units = (routing_units(position_ids, self.config.block_size)
                 if block_routing_active(self.config.block_routing_capacity, self.config.num_experts) else None)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                fn = getattr(self, "_gradient_checkpointing_func", None)
                if fn is None:
                    x = torch.utils.checkpoint.checkpoint(layer, x, position_ids, keep, None, units,
                                                          use_reentrant=False)
                else:
                    x = fn(layer.__call__, x, position_ids, keep, None, units)
            else:
                x = layer(x, position_ids, keep, cache, units, token_mask)
        return self.norm(x)

    def _keep_mask(self, attention_mask, B, L, device, cache, cache_rows):
        """Normalise every accepted mask form to one bool keep-mask (B|1, 1, L, S+L), or None = full; a
        `CopyBlockLayout` passes through (the attention computes it block by block)."""
        if isinstance(attention_mask, CopyBlockLayout):
            if cache is not None:
                cache.begin(cache_rows, device=device)
            return attention_mask
        if isinstance(cache, StaticKVCache):
            if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
                raise ValueError("a StaticKVCache needs a 4-D bool keep-mask over its whole buffer (B, 1, L, max_len)")
            return attention_mask
        if attention_mask is not None and attention_mask.dim() == 2:
            if cache is not None:
                raise ValueError("attention_mask: a 2-D padding mask cannot be combined with a cache; "
                                 "pass a 4-D keep-mask over the new tokens")
            return padding_to_block_causal(attention_mask, self.config.block_size)
        if attention_mask is not None:
            if attention_mask.dim() != 4:
                raise ValueError("attention_mask: expected 2-D (batch, len) or 4-D (batch, 1, q, k), "
                                 f"got {tuple(attention_mask.shape)}")
            if attention_mask.dtype != torch.bool:
                raise ValueError("attention_mask: 4-D masks must be boolean keep-masks (True = attend), "
                                 f"got {attention_mask.dtype}")
        if cache is None:
            if attention_mask is None:
                return block_causal_mask(L, self.config.block_size, device=device)[None, None]
            return attention_mask
        view = cache.begin(cache_rows, device=device)
        S = view.prefix_len
        if attention_mask is not None and attention_mask.shape[-1] == S + L:
            return attention_mask
        if attention_mask is None and view.uniform:
            return None  # every row's whole prefix and all new tokens: full attention, no mask to build or apply
        new_part = (attention_mask if attention_mask is not None
                    else torch.ones(1, 1, L, L, dtype=torch.bool, device=device)).expand(B, 1, L, L)
        prefix_part = view.valid[:, None, None, :].expand(B, 1, L, S)
        return torch.cat([prefix_part, new_part], dim=-1)


class LLaDA2MoeModelLM(LLaDA2MoePreTrainedModel):
    """Block-diffusion LM head model. `generate` lives in `rollout` (draft-and-edit decoding)."""

    _tied_weights_keys: dict = {}

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.model = LLaDA2MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: BlockKVCache | None = None,
                inputs_embeds: torch.Tensor | None = None, cache_rows=None, return_logits: bool = True,
                token_mask: torch.Tensor | None = None, **kwargs) -> LLaDA2MoeOutput:
        """Score `input_ids` (B, L).

        attention_mask: None (block-causal over the input with `config.block_size`), a 2-D (B, L) padding
            mask (block-causal plus padding), or a 4-D bool keep-mask (B|1, 1, L, L) such as those of
            `ebpo.model.masks`. With `cache` a 4-D mask may cover the new tokens only (L, L), combined
            with the cache's per-row prefix validity, or everything (L, S + L).
        position_ids: (B, L) or (L,) absolute positions; default 0..L-1 (after the cache's length).
        cache: a `BlockKVCache`; the new tokens' keys/values are staged and committed by the caller with
            `cache.commit(n)`. `cache_rows` picks the cache rows this batch maps to. The old keyword
            `past_key_values=` is still accepted with a FutureWarning (transformers 5.24 renamed it `cache`).
        return_logits: False skips the LM head (the learner gathers positions first).
        token_mask: optional (B, L) bool, False on padding slots whose outputs nobody reads (a decode layout's
            right padding): their MLP work is skipped (their hidden states are then meaningless).
        """
        cache = _cache_argument(cache, kwargs)
        h = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, cache_rows, token_mask)
        logits = self.lm_head(h).float() if return_logits else None
        return LLaDA2MoeOutput(logits=logits, last_hidden_state=h, cache=cache)


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _cache_argument(cache, kwargs: dict):
    """The cache passed as `cache=` or, deprecated since transformers 5.24 renamed it, `past_key_values=`."""
    old = kwargs.pop("past_key_values", None)
    if old is None:
        return cache
    if cache is not None:
        raise ValueError("pass the cache once, as `cache=` (`past_key_values=` is its deprecated name)")
    warnings.warn("`past_key_values=` is deprecated: pass `cache=` (the name transformers 5.24 uses)",
                  FutureWarning, stacklevel=3)
    return old


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant checkpointing).

    transformers 5.24 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` and
    will drop the old name in v6; older versions only have the old one.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _register_hf_expert_conversion() -> None:
    """Teach transformers 5's loader to stack released per-expert weights into our stacked parameters.

    transformers 5 loads checkpoints key by key through registered weight converters rather than
    through `load_state_dict`, so the load pre-hook above is not enough there. Older versions have no
    registry and go through `load_state_dict`, where the hook does the work.
    """
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import MergeModulelist, WeightConverter
    except ImportError:
        return
    mapping = [
        WeightConverter(source_patterns=[f"mlp.experts.*.{proj}.weight"], target_patterns=f"mlp.experts.{proj}",
                        operations=[MergeModulelist(dim=0)])
        for proj in _EXPERT_PROJS
    ]
    register_checkpoint_conversion_mapping("llada2_moe", mapping, overwrite=True)


_register_hf_expert_conversion()
