"""The learner update's per-call state and its micro-step loop, shared by `ebpo.rl.learner` and
`ebpo.rl.async_behaviour` (kept apart so that both import it without importing each other)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class UpdateState:
    """What one `EBPOLearner.update` call passes between its steps (never kept on the learner).

    cached: no-grad passes use the clean-copy KV cache; backwards_left: backward calls left in the current
    micro-batch (DeepSpeed's accumulation boundary is the last of the minibatch's last micro-batch);
    last_micro: the current micro-batch is the minibatch's last; nonfinite: optimizer steps skipped for a
    non-finite loss or gradient norm (`actor/nonfinite_steps`)."""
    cached: bool
    backwards_left: int = 0
    last_micro: bool = False
    nonfinite: int = 0


def micro_steps(plan: tuple[list[torch.Tensor], int], pad: bool) -> Iterator[tuple[torch.Tensor, bool, bool]]:
    """(rows, real, last) of each micro-step of one rank's plan `(micro-batches, n_micro)`.

    pad=False: this rank's micro-batches only. pad=True: `n_micro` steps on every rank (collectives inside
    each forward or backward need all ranks), a rank with fewer micro-batches repeating its first row
    (`real` False: the caller discards the result or weights its loss 0). last: the final step."""
    micro, n_micro = plan
    for s in range(n_micro if pad else len(micro)):
        real = s < len(micro)
        yield (micro[s] if real else micro[0][:1]), real, s == n_micro - 1
