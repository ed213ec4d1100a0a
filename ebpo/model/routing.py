"""LLaDA2.2 block routing: every diffusion block admits a fixed pool of C routed experts (docs/background.md
section 9).

The routing unit is the diffusion block *of one stream*. The model learns it from the position ids alone, in one
place (`routing_units`, called once per forward by `LLaDA2MoeModel`): a unit is a maximal run of consecutive
tokens of one row whose positions increase and share `position // block_size`. That covers every layout the
project feeds the model:
  - decode iterations and the prefix cache (rows hold [uncommitted blocks ; active block] at their absolute
    positions; right-padding slots sit past the active block, so they form units of their own);
  - the SFT / learner `[noisy ; clean]` and packed `[noisy_1 .. noisy_N ; clean]` layouts (positions restart at 0
    for every copy, so noisy block b and clean block b are separate units: separate streams);
  - `CopyBlockLayout` rows (one copy of one sequence per row) and the block-by-block likelihood.

Admission (see `block_route`) sits after the expert bias and replaces the per-token group limit by the same rule
applied to the block: biased scores -> block score g_j = max over the block's tokens -> keep `topk_group` groups
of g by the sum of each group's top-2 -> the top-C experts of g inside them are the pool -> each token takes
its top-k biased scores inside the pool; weights are its unbiased scores, normalised, times the scaling factor.
"""
from __future__ import annotations

import torch


def block_routing_active(capacity: int, num_experts: int) -> bool:
    """True when capacity C restricts anything: 0 < C < E (0 or C >= E is the per-token routing, bit for bit)."""
    return 0 < capacity < num_experts


def routing_units(position_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Routing-unit id of every token, (B, L) long, unique over the whole batch (0 .. U-1, U <= B*L).

    position_ids (B, L) absolute positions. A new unit starts at each row's first token and wherever the block
    index `position // block_size` changes or the position does not increase (a new copy of the sequence).
    """
    B, L = position_ids.shape
    blk = torch.div(position_ids, block_size, rounding_mode="floor")
    start = torch.ones(B, L, dtype=torch.bool, device=position_ids.device)
    start[:, 1:] = (blk[:, 1:] != blk[:, :-1]) | (position_ids[:, 1:] <= position_ids[:, :-1])
    return start.reshape(-1).long().cumsum(0).view(B, L) - 1


def block_pool(choice: torch.Tensor, units: torch.Tensor, capacity: int, n_group: int,
               topk_group: int) -> torch.Tensor:
    """Admitted experts of every token's unit, (T, E) bool with exactly `capacity` True per row.

    choice (T, E) fp32 biased scores (sigmoid score + expert_bias); units (T,) long ids in [0, T).
    g = max over the unit's tokens ("token racing"); keep the `topk_group` groups of g with the largest sum of
    their top-2; the pool is the top-`capacity` experts of g inside those groups. Fixed shapes (a (T, E) table
    for at most T units): no host sync, so it also runs inside a captured decode step.
    """
    T, E = choice.shape
    g = torch.full_like(choice, float("-inf")).scatter_reduce(
        0, units[:, None].expand(T, E), choice, reduce="amax", include_self=True)  # (T units max, E)
    grouped = g.view(T, n_group, E // n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)
    keep_groups = group_score.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep_groups, True)
    g = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(T, E)
    pool_idx = g.topk(capacity, dim=-1).indices
    pool = torch.zeros(T, E, dtype=torch.bool, device=choice.device).scatter_(1, pool_idx, True)
    return pool[units]


def block_route(scores: torch.Tensor, expert_bias: torch.Tensor, units: torch.Tensor, capacity: int, top_k: int,
                n_group: int, topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-routed expert choice: (topk_idx (T, k) long, pool (T, E) bool, the token's unit's admitted experts).

    scores (T, E) fp32 sigmoid scores; expert_bias (E,) fp32 (selection only); units (T,) long.
    Every chosen expert lies in the token's pool (the pool has C >= k experts, all with finite scores).
    """
    # selection is discrete: no gradient flows through it, so nothing of it is kept for the backward
    choice = scores.detach() + expert_bias.float()
    pool = block_pool(choice, units, capacity, n_group, topk_group)
    topk_idx = choice.masked_fill(~pool, float("-inf")).topk(top_k, dim=-1).indices
    return topk_idx, pool


def distinct_experts_per_unit(topk_idx: torch.Tensor, units: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(U,) long: how many distinct experts the tokens of each unit use; topk_idx (T, k), units (T,) in [0, U)."""
    U = int(units.max()) + 1 if units.numel() else 0
    used = torch.zeros(U, num_experts, dtype=torch.bool, device=topk_idx.device)
    used[units[:, None].expand_as(topk_idx), topk_idx] = True
    return used.sum(-1)


def set_block_routing(model, capacity: int) -> None:
    """Switch a loaded model's block routing to `capacity` (0 = off) in its config and every MoE gate."""
    config = model.config
    old, config.block_routing_capacity = config.block_routing_capacity, capacity
    try:
        config.validate()
    except ValueError:
        config.block_routing_capacity = old  # a refused capacity leaves the model as it was
        raise
    for module in model.modules():
        if hasattr(module, "block_routing_capacity"):
            module.block_routing_capacity = capacity


class RoutingRecorder:
    """Context manager that records, for every forward of every MoE layer, the tokens' positions and chosen
    experts: `records` is a list of (layer_idx, position_ids (B, L) long, topk_idx (B, L, k) long), CPU copies.

    Used by the tests (routing of a block across layouts) and by `ebpo bench decode` (experts per block).
    Hooks the decoder layers (their position ids are already (B, L)) and their routed experts' inputs.
    """

    def __init__(self, model):
        self.model = model
        self.records: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._handles = []
        self._pos: dict[int, torch.Tensor] = {}

    def __enter__(self) -> "RoutingRecorder":
        from ebpo.model.modeling_llada2_moe import LLaDA2MoeDecoderLayer, LLaDA2MoeSparseMoeBlock

        for module in self.model.modules():
            if isinstance(module, LLaDA2MoeDecoderLayer) and isinstance(module.mlp, LLaDA2MoeSparseMoeBlock):
                i = module.attention.layer_idx
                self._handles.append(module.register_forward_pre_hook(self._layer_hook(i)))
                self._handles.append(module.mlp.experts.register_forward_pre_hook(self._experts_hook(i)))
        return self

    def _layer_hook(self, i):
        def hook(module, args):
            # a decode layout with a token mask sends only its real tokens through the experts: keep theirs
            mask = args[5] if len(args) > 5 else None
            self._pos[i] = args[1] if mask is None else args[1][mask][None]
        return hook

    def _experts_hook(self, i):
        def hook(module, args):
            pos = self._pos[i]
            self.records.append((i, pos.detach().cpu(), args[1].detach().view(*pos.shape, -1).cpu()))
        return hook

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def experts_per_block(self, block_size: int, num_experts: int) -> torch.Tensor:
        """(n,) long: distinct experts of every (forward, layer, routing unit) recorded."""
        out = [distinct_experts_per_unit(idx.reshape(-1, idx.shape[-1]), routing_units(pos, block_size).reshape(-1),
                                         num_experts) for _, pos, idx in self.records]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
