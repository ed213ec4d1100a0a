"""Tensor-parallel pieces of the LLaDA2-MoE model: attention, the dense MLP, the vocabulary-split embedding and
LM head.

Attention and MLP are the single-process modules built at local sizes (a rank's heads, its intermediate units),
so their forward, the KV cache handling (`BlockKVCache`, `StaticKVCache`, `CopyBlockLayout`) and FP8 conversion
are the single-process code; the tensor-parallel step is one all-reduce of the partial output: the input
projection is column-parallel (each rank its heads / units), the output projection row-parallel (each rank a
partial sum over its heads / units).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ebpo.model.modeling_llada2_moe import LLaDA2MoeAttention, LLaDA2MoeMLP

from .layout import ParallelLayout


def all_reduce_(t: torch.Tensor, group) -> torch.Tensor:
    """Sum `t` over `group` in place (nothing for None or a group of one); returns t."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def all_gather_cat(t: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """The group's tensors (same shape on every rank) concatenated along `dim` in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def local_attention_config(config, layout: ParallelLayout):
    """A copy of `config` with this rank's head counts (what `LLaDA2MoeAttention` sizes itself from)."""
    local = copy.copy(config)
    local.num_attention_heads = len(layout.q_heads(config))
    local.num_key_value_heads = len(layout.kv_heads(config))
    return local


class TPAttention(LLaDA2MoeAttention):
    """`LLaDA2MoeAttention` over this rank's query heads and KV heads, output summed over the tp group.

    query_key_value holds rows [local q heads ; local k heads ; local v heads] (`sharding.qkv_rows`), dense the
    matching input columns. The KV cache passed in holds this rank's KV heads only.
    """

    def __init__(self, config, layer_idx: int, layout: ParallelLayout, group):
        super().__init__(local_attention_config(config, layout), layer_idx)
        self.group = group

    def forward(self, x, position_ids, keep_mask, cache=None):
        return all_reduce_(super().forward(x, position_ids, keep_mask, cache), self.group)


class TPMLP(LLaDA2MoeMLP):
    """SwiGLU over this rank's intermediate units (gate/up rows, down columns), output summed over the group."""

    def __init__(self, hidden_size: int, local_intermediate: int, group):
        super().__init__(hidden_size, local_intermediate)
        self.group = group

    def forward(self, x):
        return all_reduce_(super().forward(x), self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_start + local) of the vocabulary; ids of other ranks look up zeros and
    one all-reduce sums the rows: exact, since exactly one rank contributes a non-zero row per id."""

    def __init__(self, local_rows: int, hidden_size: int, vocab_start: int, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_rows, hidden_size))
        self.vocab_start, self.group = vocab_start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce_(out.masked_fill(~inside[..., None], 0.0), self.group)


class VocabParallelLMHead(nn.Module):
    """LM head rows [vocab_start, vocab_start + local): `local_logits` are this rank's slice of the logits;
    calling the module gathers the full (..., vocab) logits (the safe default for code that expects them)."""

    def __init__(self, hidden_size: int, local_rows: int, vocab_start: int, vocab_size: int, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_rows, hidden_size))
        self.vocab_start, self.vocab_size, self.group = vocab_start, vocab_size, group

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., local vocab) logits of this rank's rows (in h's dtype)."""
        return F.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab): every rank's slice gathered (one all-gather of the logits)."""
        return all_gather_cat(self.local_logits(h), self.group, dim=-1)
