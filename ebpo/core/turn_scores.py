"""Per-turn scores of multi-turn trajectories: the recipe the learner follows, as one public function.

A trajectory's model turns are scored by the block-ELBO composite (docs/ebpo.md) under the turn-aligned
response mask, then split by turn:

1. K = the model's `block_size`, the mask id = its `mask_token_id` (both from `model.config`);
2. `turn_response_mask(generated, segment, K)`: the tokens the model wrote (refuses a block that holds a
   model turn together with anything after it);
3. `draw_noise(mask, K, n_draws, t_min, t_max, generator)`: which of them are masked in each draw;
4. `all_composites(model, ids, noise, mask_id, return_blocks=True)`: the composite of each draw and its
   per-block terms;
5. `per_turn_composites(blocks, turn_index(generated, segment), K, n_turns)`: the per-block terms summed
   per turn (a block belongs to at most one turn), so the turns add up to the composite.

`score_turns(model, trajectories)` does all five on right-padded rows. Trajectories are anything with
`ids`, `generated` and `segment` (attributes or keys): `rollout.trajectory.Trajectory`, its `to_dict()`, or
`ebpo.core.turns.TurnLayout`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ebpo.core.likelihood import NoiseDraws, all_composites, draw_noise, per_turn_composites, turn_response_mask
from ebpo.core.turns import round_up, turn_index


@dataclass
class TurnScores:
    """per_turn (B, N, T) float: composite log-likelihood of turn t of row b under draw n (0 for turns a row
    does not have); composite (B, N): their sum over turns; n_turns (B,) long: model turns per row;
    noise: the draws used (masks (N, B, L), weights), so a caller can check or reuse them."""

    per_turn: torch.Tensor
    composite: torch.Tensor
    n_turns: torch.Tensor
    noise: NoiseDraws

    def mean(self) -> torch.Tensor:
        """(B, T): per-turn scores averaged over the draws (the Monte-Carlo estimate of each turn's ELBO)."""
        return self.per_turn.mean(1)


def _field(traj, name: str):
    return traj[name] if isinstance(traj, dict) else getattr(traj, name)


def trajectory_tensors(trajectories, block_size: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (B, L) long, generated (B, L) bool, segment (B, L) long), right-padded to a whole number of blocks
    (padding: `pad_id`, not generated, segment -1). Padding after a row's end cannot change its scores: a
    block attends only to itself and the blocks before it."""
    rows = [(list(_field(t, "ids")), list(_field(t, "generated")), list(_field(t, "segment"))) for t in trajectories]
    if not rows:
        raise ValueError("score_turns: no trajectories")
    for i, (ids, gen, seg) in enumerate(rows):
        if not len(ids) == len(gen) == len(seg):
            raise ValueError(f"score_turns: row {i}: ids, generated and segment differ in length "
                             f"({len(ids)}, {len(gen)}, {len(seg)})")
    L = round_up(max(len(r[0]) for r in rows), block_size)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    gen = torch.zeros(len(rows), L, dtype=torch.bool)
    seg = torch.full((len(rows), L), -1, dtype=torch.long)
    for i, (a, g, s) in enumerate(rows):  # the assignments cast each row to the typed tensors above
        ids[i, :len(a)] = torch.as_tensor(a)
        gen[i, :len(g)] = torch.as_tensor(g)
        seg[i, :len(s)] = torch.as_tensor(s)
    return ids, gen, seg


@torch.no_grad()
def score_turns(model, trajectories, n_draws: int = 4, t_min: float = 0.1, t_max: float = 1.0, seed: int = 0,
                generator: torch.Generator | None = None) -> TurnScores:
    """Per-turn composite log-likelihoods of multi-turn trajectories under `model` (module docstring).

    trajectories: B records with `ids`, `generated`, `segment` (one entry per token, turns block-aligned as
    `rollout.multiturn` and `ebpo.core.turns.layout_segments` lay them out). n_draws, t_min, t_max: the
    noise draws (as `learner.n_draws`, `learner.t_min`, `learner.t_max`); seed or generator: their
    randomness (the generator wins; it must be on the model's device). No gradient; the model's mode is
    left as it is (call `.eval()` first for scores without dropout).
    """
    cfg = model.config
    K, mask_id = int(cfg.block_size), int(cfg.mask_token_id)
    pad_id = getattr(cfg, "pad_token_id", None)
    ids, gen, seg = trajectory_tensors(trajectories, K, mask_id if pad_id is None else int(pad_id))
    dev = next(model.parameters()).device
    ids, gen, seg = ids.to(dev), gen.to(dev), seg.to(dev)
    if generator is None:
        generator = torch.Generator(device=dev).manual_seed(seed)
    noise = draw_noise(turn_response_mask(gen, seg, K), K, n_draws, t_min, t_max, generator)
    composite, blocks = all_composites(model, ids, noise, mask_id, return_blocks=True)
    turns = turn_index(gen, seg)
    n_turns = turns.amax(1).clamp(min=-1) + 1
    per_turn = per_turn_composites(blocks, turns, K, max(1, int(n_turns.max())))
    return TurnScores(per_turn=per_turn, composite=composite, n_turns=n_turns, noise=noise)
