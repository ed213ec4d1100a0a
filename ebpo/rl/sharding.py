"""How a learner group splits an RL batch: rows to ranks balanced by tokens, then token-budget micro-batches.

Pure functions of row indices and lengths (no torch.distributed): every rank computes the same plan from
the same batch, so nobody has to send it. The plan never changes what is computed, only where and in how
many pieces: the loss is normalised by the whole minibatch's row count (`loss_weight`), so W ranks and any
micro-batching give the update of one rank on the whole minibatch, up to floating-point reduction order.
"""
from __future__ import annotations

import torch


def padded_lengths(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B,) sequence lengths (prompt + response, tokens) rounded up to whole blocks of `block_size`: the
    columns a row needs in the likelihood forward (blocks past a row's last one are never seen by it)."""
    return (seq_lens.long() + block_size - 1) // block_size * block_size


def balance_by_tokens(rows: torch.Tensor, tokens: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split the row indices `rows` (R,) over `world_size` ranks so that each rank's token count is as even
    as greedy longest-first can make it; `tokens` (B,) is indexed by row id.

    Returns one index tensor per rank, each keeping the order the rows had in `rows`. Ties (equal lengths,
    equal loads) go to the lowest row position / rank, so the plan is deterministic. With R >= world_size
    every rank gets at least one row. world_size 1 returns `[rows]` unchanged.
    """
    if world_size == 1:
        return [rows]
    cost = tokens[rows].tolist()
    order = sorted(range(len(cost)), key=lambda i: (-cost[i], i))
    load = [0] * world_size
    owner = [0] * len(cost)
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += cost[i]
    return [rows[[i for i in range(len(cost)) if owner[i] == r]] for r in range(world_size)]


def token_microbatches(rows: torch.Tensor, tokens: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Cut `rows` into micro-batches of at most `budget` tokens each, counting rows x the longest padded
    length in the micro-batch (what a right-padded forward costs); a row longer than the budget goes alone.

    Rows are sorted by length (longest first, stable) so that rows of similar length share a micro-batch
    and little padding is computed. budget <= 0 returns `[rows]` (one micro-batch, original order).
    """
    if budget <= 0 or len(rows) == 0:
        return [rows]
    cost = tokens[rows].tolist()
    order = sorted(range(len(cost)), key=lambda i: (-cost[i], i))
    out, current, width = [], [], 0
    for i in order:
        new_width = max(width, cost[i])
        if current and new_width * (len(current) + 1) > budget:
            out.append(rows[current])
            current, new_width = [], cost[i]
        current.append(i)
        width = new_width
    out.append(rows[current])
    return out


def loss_weight(rows_here: int, rows_in_minibatch: int) -> float:
    """Factor of a micro-batch's mean loss so that the gradients summed over all micro-batches of all ranks
    equal the gradient of the mean over the whole minibatch. Exactly 1.0 for the whole minibatch at once."""
    return 1.0 if rows_here == rows_in_minibatch else rows_here / rows_in_minibatch
