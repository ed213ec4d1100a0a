"""Expert-parallel MoE block: replicated router, routed experts split over the ep ranks, all-to-all dispatch.

Every rank of the ep group holds the same tokens (activations are replicated) and the same router, so every rank
computes the same routing for all T tokens, block routing included (a block's pool needs all its tokens). Rank e
then owns a contiguous 1/ep slice of the tokens and:
  1. sends each of its (token, chosen expert) pairs' hidden row to the rank holding that expert
     (`dist.all_to_all_single`; split sizes are known on every rank from the replicated routing, so no count
     exchange is needed);
  2. runs its local experts on what it received (the single-process experts module, k = 1 and weight 1 per row);
  3. sends the expert outputs back (`all_to_all_single` with the splits reversed), weights and sums them per
     token exactly as the single-process block does;
  4. all-gathers the token slices so the block's output is replicated again.
The shared expert is tensor-parallel (one all-reduce, `TPMLP`) or replicated (`shared_expert="replicate"`).
One host sync per layer: the split sizes of the all-to-all. Inference only (no autograd through the collectives).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from ebpo.model.modeling_llada2_moe import LLaDA2MoeExperts, LLaDA2MoeGate, LLaDA2MoeMLP

from .layers import TPMLP
from .layout import ParallelLayout


def token_slices(T: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous token slices of T tokens (the first T % parts one longer)."""
    return [T // parts + (1 if i < T % parts else 0) for i in range(parts)]


class EPMoE(nn.Module):
    """The MoE block of one layer on one rank: `gate` (whole), `experts` (this rank's E / ep, stacked, under the
    single-process name), `shared_experts` (tp-split or whole). forward(x (B, L, H), units (B, L)) -> (B, L, H)."""

    def __init__(self, config, layout: ParallelLayout, tp_group, ep_group):
        super().__init__()
        self.gate = LLaDA2MoeGate(config)
        local = copy.copy(config)
        local.num_experts = len(layout.experts(config))
        self.experts = LLaDA2MoeExperts(local)
        self.expert_start = layout.experts(config).start
        self.ep_group, self.ep_size, self.ep_rank = ep_group, layout.ep_size, layout.ep_rank
        self.shared_experts = None
        if config.num_shared_experts > 0:
            units = len(layout.shared_ffn(config))
            self.shared_experts = (LLaDA2MoeMLP(config.hidden_size, units) if layout.shared_expert == "replicate"
                                   else TPMLP(config.hidden_size, units, tp_group))

    def forward(self, x: torch.Tensor, units: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        topk_idx, topk_weight, pool = self.gate.route(flat, None if units is None else units.reshape(-1))
        if self.ep_size == 1:  # every expert here: the single-process call
            out = (self.experts(flat, topk_idx, topk_weight) if pool is None
                   else self.experts(flat, topk_idx, topk_weight, pool=pool))
        else:
            out = self._routed(flat, topk_idx, topk_weight)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def _routed(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """sum_j w_j expert_{idx_j}(x) for all T tokens: dispatch, local experts, combine, gather (module doc)."""
        T, k = topk_idx.shape
        P, me = self.ep_size, self.ep_rank
        if T == 0:
            return torch.zeros_like(x)
        sizes = token_slices(T, P)
        t0 = sum(sizes[:me])
        per_rank = self.experts.num_experts
        dest = topk_idx // per_rank  # (T, k) ep rank holding each chosen expert
        owner = torch.repeat_interleave(torch.arange(P, device=x.device), torch.tensor(sizes, device=x.device))
        # pairs from token slice s to rank d, for all (s, d): every rank derives the same table
        counts = torch.zeros(P * P, dtype=torch.long, device=x.device).index_add_(
            0, (owner[:, None] * P + dest).reshape(-1), torch.ones(T * k, dtype=torch.long, device=x.device))
        counts = counts.view(P, P).tolist()  # the one host sync: all_to_all_single takes host split sizes
        send_counts = counts[me]
        recv_counts = [counts[s][me] for s in range(P)]

        mine = dest[t0:t0 + sizes[me]].reshape(-1)
        order = mine.argsort(stable=True)  # my pairs grouped by destination rank
        send = x[t0 + order // k]
        recv = x.new_empty(sum(recv_counts), x.shape[1])
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.ep_group)

        # what arrives: from each source slice in order, its pairs bound here in their token-major order
        # (the stable sort keeps it), so their experts follow from the replicated routing
        here = (dest == me).reshape(-1)
        local_expert = topk_idx.reshape(-1)[here] - self.expert_start
        y = self.experts(recv, local_expert[:, None], torch.ones(recv.shape[0], 1, device=x.device))

        back = x.new_empty(send.shape[0], x.shape[1])
        dist.all_to_all_single(back, y.contiguous(), send_counts, recv_counts, group=self.ep_group)
        w = topk_weight[t0:t0 + sizes[me]].reshape(-1)[order].to(back.dtype)
        out = torch.zeros(sizes[me], x.shape[1], dtype=x.dtype, device=x.device)
        out.index_add_(0, order // k, back * w[:, None])
        return self._gather_slices(out, sizes)

    def _gather_slices(self, out: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """(T, H): every rank's token slice, in order (slices padded to the longest for the all-gather)."""
        longest = sizes[0]
        padded = out.new_zeros(longest, out.shape[1])
        padded[: out.shape[0]] = out
        parts = [torch.empty_like(padded) for _ in range(self.ep_size)]
        dist.all_gather(parts, padded, group=self.ep_group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])
