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


# Fixed cost of one micro-batch forward/backward, in token slots: the per-call work (noise-draw slicing,
# masks, kernel launches, Python) that a micro-batch pays whatever its size; one 32-token block. It keeps
# the plan from splitting rows of nearly equal length into separate forwards. `ebpo bench learner`
# (docs/rl.md, 16 rows 8x apart in length): the old greedy fill (rows packed up to the budget, 3
# micro-batches, 3392 token slots for 2432 real tokens) gave 1.39-1.47x the padded speed; this plan (8
# micro-batches, 2688 slots, no padding block) 1.75x; an overhead of 96 (4 micro-batches, 2944 slots) 1.63x.
MICROBATCH_OVERHEAD_TOKENS = 32


def token_microbatches(rows: torch.Tensor, tokens: torch.Tensor, budget: int,
                       overhead: int = MICROBATCH_OVERHEAD_TOKENS) -> list[torch.Tensor]:
    """Cut `rows` into micro-batches of at most `budget` tokens each, counting rows x the longest padded
    length in the micro-batch (what a right-padded forward costs); a row longer than the budget goes alone.

    Rows are sorted by length (longest first, stable) and cut into consecutive runs that minimise the
    plan's cost, sum over micro-batches of (rows x longest length + `overhead`) token slots, by dynamic
    programming: rows of similar length share a micro-batch, so little padding is computed, and rows of
    equal length are not split without need. Ties go to fewer micro-batches. budget <= 0 returns `[rows]`
    (one micro-batch, original order).
    """
    if budget <= 0 or len(rows) == 0:
        return [rows]
    cost = tokens[rows].tolist()
    order = sorted(range(len(cost)), key=lambda i: (-cost[i], i))
    width = [cost[i] for i in order]  # descending
    n = len(order)
    best = [0] + [float("inf")] * n  # best[j]: cheapest plan of the first j rows (in `order`)
    start = [0] * (n + 1)  # the first row of the plan's last micro-batch
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # last micro-batch = order[i:j], its width that of row i
            size = (j - i) * width[i]
            if j - i > 1 and size > budget:
                break  # earlier i only add rows and width
            value = best[i] + size + overhead
            if value <= best[j]:
                best[j], start[j] = value, i
    cuts, j = [], n
    while j > 0:
        cuts.append((start[j], j))
        j = start[j]
    return [rows[order[i:j]] for i, j in reversed(cuts)]


def loss_weight(rows_here: int, rows_in_minibatch: int) -> float:
    """Factor of a micro-batch's mean loss so that the gradients summed over all micro-batches of all ranks
    equal the gradient of the mean over the whole minibatch. Exactly 1.0 for the whole minibatch at once."""
    return 1.0 if rows_here == rows_in_minibatch else rows_here / rows_in_minibatch
