"""The tensor- and expert-parallel LLaDA2-MoE model of one rank, and `build_parallel_model`.

`ParallelLLaDA2MoeLM` has the forward of `LLaDA2MoeModelLM` (same arguments, same output type) and the same
state-dict names, with this rank's shapes. The decoder layer's and the model body's forward are the
single-process functions themselves (masks, routing units, token masks and caches stay defined in one place);
only the modules they call are the parallel ones.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from kernels.fp8 import convert_model_to_fp8

from ebpo.model.cache import BlockKVCache, StaticKVCache
from ebpo.model.modeling_llada2_moe import (LLaDA2MoeDecoderLayer, LLaDA2MoeModel, LLaDA2MoeOutput,
                                             LLaDA2MoeRMSNorm)

from .layers import TPAttention, TPMLP, VocabParallelEmbedding, VocabParallelLMHead
from .layout import ParallelLayout, check_layout, layout_for
from .moe import EPMoE
from .sampling import VocabShard, sharded_candidates, sharded_token_probs
from .sharding import ShardLoader


class ParallelDecoderLayer(nn.Module):
    """Pre-norm decoder layer of one rank: TP attention, then TP dense MLP or EP MoE."""

    forward = LLaDA2MoeDecoderLayer.forward  # the single-process layer (token-mask packing, routing units)

    def __init__(self, config, layer_idx: int, layout: ParallelLayout, tp_group, ep_group):
        super().__init__()
        self.input_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = TPAttention(config, layer_idx, layout, tp_group)
        self.post_attention_layernorm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = TPMLP(config.hidden_size, len(layout.dense_ffn(config)), tp_group)
        else:
            self.mlp = EPMoE(config, layout, tp_group, ep_group)

    def _mlp(self, h, units):
        return self.mlp(h, units) if isinstance(self.mlp, EPMoE) else self.mlp(h)


class ParallelLLaDA2MoeModel(nn.Module):
    """Embedding (vocabulary-split), layers, final norm: returns the final-normed hidden states, replicated."""

    forward = LLaDA2MoeModel.forward  # keep-mask normalisation, positions and routing units: one definition
    _keep_mask = LLaDA2MoeModel._keep_mask

    def __init__(self, config, layout: ParallelLayout, tp_group, ep_group):
        super().__init__()
        self.config = config
        vocab = layout.vocab(config)
        self.word_embeddings = VocabParallelEmbedding(len(vocab), config.hidden_size, vocab.start, tp_group)
        self.layers = nn.ModuleList(ParallelDecoderLayer(config, i, layout, tp_group, ep_group)
                                    for i in range(config.num_hidden_layers))
        self.norm = LLaDA2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False


class ParallelLLaDA2MoeLM(nn.Module):
    """One rank of a tensor- and expert-parallel `LLaDA2MoeModelLM` (inference only).

    forward(...) takes `LLaDA2MoeModelLM.forward`'s arguments (input_ids, attention_mask, position_ids, cache,
    inputs_embeds, cache_rows, return_logits, token_mask) and returns an `LLaDA2MoeOutput`; hidden states are
    replicated on every rank. `cache` must be this rank's cache (`new_cache`: its KV heads only). With
    return_logits=True the full logits are all-gathered; decoding uses `candidates` instead.
    """

    def __init__(self, config, layout: ParallelLayout, tp_group=None, ep_group=None):
        super().__init__()
        self.config, self.layout = config, layout
        self.tp_group, self.ep_group = tp_group, ep_group
        self.model = ParallelLLaDA2MoeModel(config, layout, tp_group, ep_group)
        vocab = layout.vocab(config)
        self.lm_head = VocabParallelLMHead(config.hidden_size, len(vocab), vocab.start, config.vocab_size, tp_group)

    @property
    def vocab_shard(self) -> VocabShard:
        """This rank's vocabulary slice and the group that holds the others."""
        vocab = self.layout.vocab(self.config)
        return VocabShard(vocab.start, vocab.stop, self.config.vocab_size, self.tp_group)

    @torch.no_grad()
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                cache_rows=None, return_logits: bool = True, token_mask=None, **kwargs) -> LLaDA2MoeOutput:
        """See `LLaDA2MoeModelLM.forward`; every rank of both groups must call it with the same batch."""
        h = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, cache_rows, token_mask,
                       **kwargs)
        logits = self.lm_head(h).float() if return_logits else None
        return LLaDA2MoeOutput(logits=logits, last_hidden_state=h, cache=cache)

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   generators=None, suppress: torch.Tensor | None = None, penalty: float = 0.0,
                   banned: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate token and probability per position from hidden states (B, K, H), with the vocabulary
        split: `sampling.sharded_candidates` on this rank's logits; `banned` token ids get -inf first."""
        local = _ban(self.lm_head.local_logits(hidden).float(), self.vocab_shard, banned)
        return sharded_candidates(local, self.vocab_shard, temperature, top_k, top_p, generators, suppress, penalty)

    @torch.no_grad()
    def token_probs(self, hidden: torch.Tensor, ids: list[int], banned: Iterable[int] = ()) -> torch.Tensor:
        """(B, K, len(ids)) fp32: softmax probabilities of the tokens `ids` (after banning `banned`)."""
        local = _ban(self.lm_head.local_logits(hidden).float(), self.vocab_shard, banned)
        return sharded_token_probs(local, self.vocab_shard, ids)

    def local_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return len(self.layout.kv_heads(self.config))

    def new_cache(self, batch_size: int, max_len: int, dtype=torch.float32, device=None, static: bool = False):
        """This rank's `BlockKVCache` (or `StaticKVCache`): every layer, only this rank's KV heads."""
        cls = StaticKVCache if static else BlockKVCache
        return cls(self.config.num_hidden_layers, batch_size, max_len, self.local_kv_heads(), self.config.head_dim,
                   dtype=dtype, device=device)


def _ban(local: torch.Tensor, shard: VocabShard, banned: Iterable[int]) -> torch.Tensor:
    ids = [int(t) - shard.start for t in banned if shard.start <= int(t) < shard.stop]
    if ids:
        local[..., ids] = float("-inf")
    return local


def _pairs(source) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        return source.state_dict().items()
    if isinstance(source, Mapping):
        return source.items()
    return source


def build_parallel_model(source, config, tp_group=None, ep_group=None, *, fp8: bool = False,
                         shared_expert: str = "tp", dtype: torch.dtype = torch.float32, device=None,
                         fp8_backend: str = "auto") -> ParallelLLaDA2MoeLM:
    """This rank's parallel model.

    source: a full `LLaDA2MoeModelLM`, its state dict, an iterable of (name, full tensor) pairs (streamed: each
        rank keeps only its slices), or None (weights left zero: stream them later with a `ShardLoader`).
    tp_group / ep_group: the tensor- / expert-parallel process groups of this rank (None: that axis unsplit).
    fp8: per-block FP8 linear layers and routed experts (router, norms, embedding and LM head stay in `dtype`);
        each rank quantises its own block-aligned slices.
    shared_expert: "tp" (split over tp_group) or "replicate".
    Raises ValueError (naming the field) when the config cannot be split this way (`check_layout`).
    """
    layout = layout_for(tp_group, ep_group, shared_expert, fp8)
    return shard_model(source, config, layout, tp_group, ep_group, dtype=dtype, device=device,
                       fp8_backend=fp8_backend)


def shard_model(source, config, layout: ParallelLayout, tp_group=None, ep_group=None, *,
                dtype: torch.dtype = torch.float32, device=None, fp8_backend: str = "auto") -> ParallelLLaDA2MoeLM:
    """`build_parallel_model` for an explicit `layout` (the groups must match it: their sizes and this rank's
    ranks); allocates only this rank's shards, loads `source` slice by slice, then quantises when layout.fp8."""
    check_layout(config, layout)
    with torch.device("meta"):
        model = ParallelLLaDA2MoeLM(config, layout, tp_group, ep_group)
    model = model.to_empty(device=device or "cpu").to(dtype)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.zero_()  # defined contents until loaded (to_empty leaves whatever the memory held)
    model.requires_grad_(False)
    if source is not None:
        ShardLoader(model).load_all(_pairs(source)).finish()
    if layout.fp8:
        convert_model_to_fp8(model, backend=fp8_backend)  # quantises each rank's slices (block-aligned)
    return model.eval()
