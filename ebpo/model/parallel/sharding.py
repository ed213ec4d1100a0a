"""Each rank's slice of every full-model parameter, and a loader that streams full tensors into the shards.

Parameter names are those of the single-process `LLaDA2MoeModelLM` state dict (stacked experts
`...mlp.experts.gate_proj`, or the released per-expert `...mlp.experts.{e}.gate_proj.weight`), so a learner's
state dict, a checkpoint read tensor by tensor, or a weight-sync stream load without renaming. The parallel
model keeps those names with local shapes.

Slicing rules (t = tp rank, e = ep rank; see `ParallelLayout` for the ranges):
  query_key_value      rows of this rank's query heads, then its KV heads' key rows, then their value rows
  attention.dense      input columns of this rank's query heads; its bias only on tp rank 0 (zeros elsewhere,
                       so the all-reduce adds it once)
  dense MLP, shared    gate/up: rows of the rank's intermediate units; down: the same columns
  routed experts       the rank's contiguous experts (stacked: rows of dim 0; per-expert names: only its own)
  embedding, lm_head   the rank's vocabulary rows
  everything else      whole (norms, router weight and expert bias)
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kernels.fp8 import FP8Experts, FP8Linear, expected_keys

from .layout import ParallelLayout

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"\.experts\.(gate_proj|up_proj|down_proj)$")


def qkv_rows(config, layout: ParallelLayout) -> torch.Tensor:
    """(rows,) long: the rows of the fused (nh + 2 nkv) * head_dim query_key_value weight this rank holds,
    in its local order [its query heads ; its key heads ; its value heads]."""
    D, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q, kv = layout.q_heads(config), layout.kv_heads(config)
    heads = list(q) + [nh + h for h in kv] + [nh + nkv + h for h in kv]
    return (torch.tensor(heads)[:, None] * D + torch.arange(D)[None, :]).reshape(-1)


def _rows(full: torch.Tensor, r: range) -> torch.Tensor:
    return full.narrow(0, r.start, len(r))


def _cols(full: torch.Tensor, r: range) -> torch.Tensor:
    return full.narrow(-1, r.start, len(r))


def local_slice(name: str, full: torch.Tensor, config, layout: ParallelLayout) -> torch.Tensor | None:
    """This rank's part of the full-model parameter `name` (a view where a narrow does), or None when the rank
    holds none of it (another rank's routed expert under its per-expert name)."""
    m = _PER_EXPERT.match(name)
    if m:
        return full if int(m.group(2)) in layout.experts(config) else None
    if _STACKED.search(name):
        return _rows(full, layout.experts(config))
    if name.endswith("attention.query_key_value.weight") or name.endswith("attention.query_key_value.bias"):
        return full.index_select(0, qkv_rows(config, layout).to(full.device))
    if name.endswith("attention.dense.weight"):
        q = layout.q_heads(config)
        return _cols(full, range(q.start * config.head_dim, q.stop * config.head_dim))
    if name.endswith("attention.dense.bias"):
        return full if layout.tp_rank == 0 else torch.zeros_like(full)
    shared = ".mlp.shared_experts." in name
    ffn = layout.shared_ffn(config) if shared else layout.dense_ffn(config)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "shared_experts.gate_proj.weight",
                      "shared_experts.up_proj.weight")):
        return _rows(full, ffn)
    if name.endswith(("mlp.down_proj.weight", "shared_experts.down_proj.weight")):
        return _cols(full, ffn)
    if name.endswith("word_embeddings.weight") or name == "lm_head.weight":
        return _rows(full, layout.vocab(config))
    return full


class ShardLoader:
    """Stream (name, full tensor) pairs into a parallel model; each rank copies only its slice.

        loader = ShardLoader(model)
        for name, tensor in stream:   # one full tensor at a time: the full model never sits on one rank
            loader.load(name, tensor)
        loader.finish()               # raises naming the parameters never loaded

    FP8 layers re-quantise their slice on load (shard, then quantise per rank). A partial stream (one bucket of a
    weight sync) may call `finish(allow_missing=True)` or skip it.
    """

    def __init__(self, model):
        self.model = model
        self.config, self.layout = model.config, model.layout
        self._targets = expected_keys(model)
        self._loaded: set[str] = set()
        self._experts: dict[str, set[int]] = {}

    def load(self, name: str, full: torch.Tensor) -> bool:
        """Copy this rank's slice of `full` (the whole parameter `name`) in place; True when the rank holds any
        of it. Unknown names and wrong shapes raise ValueError naming the parameter."""
        m = _PER_EXPERT.match(name)
        if m:
            key, e = f"{m.group(1)}.{m.group(3)}", int(m.group(2))
            if key not in self._targets or not 0 <= e < self.config.num_experts:
                raise ValueError(f"ShardLoader: unexpected parameter {name!r}")
            experts = self.layout.experts(self.config)
            if e not in experts:
                return False
            self._write(key, full, expert=e - experts.start)
            self._experts.setdefault(key, set()).add(e)
            if len(self._experts[key]) == len(experts):
                self._loaded.add(key)
            return True
        if name not in self._targets:
            raise ValueError(f"ShardLoader: unexpected parameter {name!r}")
        self._write(name, local_slice(name, full, self.config, self.layout))
        self._loaded.add(name)
        return True

    def load_all(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> "ShardLoader":
        """`load` every pair; returns self."""
        for name, tensor in pairs:
            self.load(name, tensor)
        return self

    def missing(self) -> list[str]:
        """Parameters of this rank not loaded yet (sorted)."""
        return sorted(self._targets - self._loaded)

    def finish(self, allow_missing: bool = False) -> None:
        """Raise ValueError when a parameter of this rank was never loaded (unless `allow_missing`)."""
        missing = self.missing()
        if missing and not allow_missing:
            raise ValueError(f"ShardLoader: {len(missing)} parameters never loaded: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")

    @torch.no_grad()
    def _write(self, name: str, value: torch.Tensor, expert: int | None = None) -> None:
        prefix, _, attr = name.rpartition(".")
        mod = self.model.get_submodule(prefix)
        if isinstance(mod, FP8Linear) and attr == "weight":
            mod.requantize_(value)
            return
        if isinstance(mod, FP8Experts):
            mod.requantize_(attr, value, expert=expert)
            return
        target = getattr(mod, attr)
        if expert is not None:
            target = target[expert]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"ShardLoader: {name}: this rank's slice has shape {tuple(value.shape)}, the shard "
                             f"expects {tuple(target.shape)} (is the config the checkpoint's?)")
        target.copy_(value)
