"""Which part of the LLaDA2-MoE model one rank holds, and the start-up checks of a parallel layout.

Two independent axes, each a process group whose ranks all run the same batch (activations are replicated):
  - tensor parallel (`tp`): attention heads, the dense MLP, the shared expert and the vocabulary (embedding and
    LM head) are split over the tp ranks;
  - expert parallel (`ep`): the routed experts are split over the ep ranks, each rank also dispatching a
    contiguous 1/ep slice of the tokens (see `ebpo.model.parallel.moe`).

`ParallelLayout` is plain data (sizes and ranks), so every slicing rule is a pure function of it and the config.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

SHARED_EXPERT_MODES = ("tp", "replicate")
FP8_BLOCK = 128  # kernels.fp8_ops.BLOCK: per-block FP8 scales cover 128 x 128 weight tiles


@dataclass(frozen=True)
class ParallelLayout:
    """tp_size/tp_rank and ep_size/ep_rank of this rank; `shared_expert` "tp" (split like the dense MLP, one
    all-reduce) or "replicate" (whole on every rank, no collective); `fp8` whether linear layers and routed
    experts are per-block FP8 (then every tensor-parallel slice must be aligned to the 128-wide blocks)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    shared_expert: str = "tp"
    fp8: bool = False

    def q_heads(self, config) -> range:
        """Query heads of this rank (contiguous)."""
        n = config.num_attention_heads // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def kv_heads(self, config) -> range:
        """KV heads of this rank: nkv / tp of them, or the one KV head its query heads read when tp > nkv
        (each KV head then replicated on tp / nkv ranks)."""
        nkv = config.num_key_value_heads
        if self.tp_size <= nkv:
            n = nkv // self.tp_size
            return range(self.tp_rank * n, (self.tp_rank + 1) * n)
        group = config.num_attention_heads // nkv  # query heads per KV head
        head = self.q_heads(config).start // group
        return range(head, head + 1)

    def experts(self, config) -> range:
        """Routed experts of this rank (contiguous)."""
        n = config.num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def vocab(self, config) -> range:
        """Vocabulary rows (embedding and LM head) of this rank."""
        n = config.vocab_size // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def dense_ffn(self, config) -> range:
        """Intermediate units of the dense MLP layers held here."""
        n = config.intermediate_size // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def shared_ffn(self, config) -> range:
        """Intermediate units of the shared expert held here (all of them when it is replicated)."""
        total = config.moe_intermediate_size * config.num_shared_experts
        if self.shared_expert == "replicate" or self.tp_size == 1:
            return range(total)
        n = total // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)


def _has_moe(config) -> bool:
    return config.first_k_dense_replace < config.num_hidden_layers


def _has_dense(config) -> bool:
    return config.first_k_dense_replace > 0


def check_layout(config, layout: ParallelLayout) -> None:
    """Raise ValueError naming the config field (or layout field) that the layout cannot split.

    Needs: heads divisible by tp; KV heads divisible by tp or tp divisible by KV heads (KV replication);
    dense and (when tp-split) shared-expert intermediate sizes and the vocabulary divisible by tp; experts
    divisible by ep. With FP8 and tp > 1, every split of a quantised matrix must fall on 128-wide FP8 blocks,
    so that each rank's quantised slice is exactly the slice of the single-process quantisation.
    """
    tp, ep = layout.tp_size, layout.ep_size

    def need(cond: bool, field: str, msg: str) -> None:
        if not cond:
            raise ValueError(f"parallel layout (tp={tp}, ep={ep}): {field}: {msg}")

    need(tp >= 1 and 0 <= layout.tp_rank < tp, "tp_rank", f"must lie in [0, {tp}), got {layout.tp_rank}")
    need(ep >= 1 and 0 <= layout.ep_rank < ep, "ep_rank", f"must lie in [0, {ep}), got {layout.ep_rank}")
    need(layout.shared_expert in SHARED_EXPERT_MODES, "shared_expert",
         f"must be one of {SHARED_EXPERT_MODES}, got {layout.shared_expert!r}")
    nh, nkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    need(nh % tp == 0, "num_attention_heads", f"{nh} heads cannot be split over tp={tp} ranks")
    need(nkv % tp == 0 or tp % nkv == 0, "num_key_value_heads",
         f"{nkv} KV heads: tp={tp} must divide them or be a multiple of them (KV heads replicated)")
    need(config.vocab_size % tp == 0, "vocab_size", f"{config.vocab_size} is not divisible by tp={tp}")
    if _has_dense(config):
        need(config.intermediate_size % tp == 0, "intermediate_size",
             f"{config.intermediate_size} is not divisible by tp={tp}")
    shared = config.moe_intermediate_size * config.num_shared_experts
    split_shared = _has_moe(config) and shared > 0 and layout.shared_expert == "tp"
    if split_shared:
        need(shared % tp == 0, "moe_intermediate_size",
             f"the shared expert's {shared} units are not divisible by tp={tp} (or use shared_expert='replicate')")
    if _has_moe(config):
        need(config.num_experts % ep == 0, "num_experts", f"{config.num_experts} experts cannot be split over ep={ep}")
    if layout.fp8 and tp > 1:
        kv_local = max(nkv // tp, 1)
        need((nh // tp) * D % FP8_BLOCK == 0 and kv_local * D % FP8_BLOCK == 0, "head_dim",
             f"FP8 with tp={tp}: each rank's query rows ({nh // tp} x {D}) and KV rows ({kv_local} x {D}) must be "
             f"multiples of {FP8_BLOCK}")
        if _has_dense(config):
            need(config.intermediate_size // tp % FP8_BLOCK == 0, "intermediate_size",
                 f"FP8 with tp={tp}: {config.intermediate_size // tp} units per rank is not a multiple of {FP8_BLOCK}")
        if split_shared:
            need(shared // tp % FP8_BLOCK == 0, "moe_intermediate_size",
                 f"FP8 with tp={tp}: the shared expert's {shared // tp} units per rank are not a multiple of "
                 f"{FP8_BLOCK} (or use shared_expert='replicate')")


def group_size_rank(group) -> tuple[int, int]:
    """(size, rank) of a process group; (1, 0) for None (that axis is not split)."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def layout_for(tp_group=None, ep_group=None, shared_expert: str = "tp", fp8: bool = False) -> ParallelLayout:
    """The layout of the calling rank from its tensor- and expert-parallel groups (None: that axis unsplit)."""
    tp_size, tp_rank = group_size_rank(tp_group)
    ep_size, ep_rank = group_size_rank(ep_group)
    return ParallelLayout(tp_size, tp_rank, ep_size, ep_rank, shared_expert, fp8)


def make_groups(tp: int, ep: int):
    """(tp_group, ep_group) of the calling rank: consecutive ranks of the default world, `tp` resp. `ep` per
    group (`torch.distributed.new_subgroups`). Every rank of the world must call it. The world size must be a
    multiple of both; ranks of one ep group must all run the same batch (they share its tokens)."""
    world = dist.get_world_size()
    for name, n in (("tp", tp), ("ep", ep)):
        if n < 1 or world % n:
            raise ValueError(f"make_groups: {name}={n} must be >= 1 and divide the world size {world}")
    tp_group = dist.new_subgroups(group_size=tp)[0] if tp > 1 else None
    ep_group = dist.new_subgroups(group_size=ep)[0] if ep > 1 else None
    return tp_group, ep_group
