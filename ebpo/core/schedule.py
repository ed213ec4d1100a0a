"""The one learning-rate schedule of every trainer (CPT/SFT and RL): linear warm-up, then constant or cosine."""
from __future__ import annotations

import math


def lr_schedule(progress: float, step_frac: float, warmup: int, total: int, schedule: str = "cosine",
                min_ratio: float = 0.0) -> float:
    """LR multiplier of the optimizer step that starts at `progress` (in schedule units: optimizer steps
    for CPT/SFT, RL updates for RL) and lasts `step_frac` units.

    Warm-up is linear in the step's end, so the very first step trains: (progress + step_frac) / warmup
    while that end is at most `warmup`. After it, `schedule` "constant" gives 1; "cosine" decays from 1
    at `warmup` to `min_ratio` at `total`, evaluated at the step's start (so the last scheduled step
    still trains when min_ratio is 0), and stays there after `total`.
    """
    end = progress + step_frac
    if warmup > 0 and end <= warmup:
        return end / warmup
    if schedule == "cosine":
        q = (progress - warmup) / max(total - warmup, 1)
        return min_ratio + (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(max(q, 0.0), 1.0)))
    if schedule != "constant":
        raise ValueError(f"schedule: choose constant or cosine, got {schedule!r}")
    return 1.0
