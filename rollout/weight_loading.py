"""Load a learner state dict into a rollout model in parts, as broadcast buckets arrive.

A rollout worker that loaded only after the whole broadcast held a second copy of the weights during
every sync (32 GB for LLaDA2.1-mini in bf16). `StreamingWeightLoader` copies (or, for FP8 layers,
re-quantises) each bucket's tensors into the model as soon as that bucket is received, so the extra
memory is one bucket (`ray.bucket_mb`). A tensor never spans two buckets (`rollout.weight_sync.plan_buckets`),
so every part holds whole tensors under the model's own names.
"""
from __future__ import annotations

import torch
from torch import nn


class StreamingWeightLoader:
    """`load_part(part)` for each part of a state dict, then `finish()`.

    model: the rollout model (converted to FP8 when `fp8`). A key the model does not have raises at once;
    keys no part delivered raise in `finish()`. Either way the model is then partly updated: the caller
    must reload it in full (the trainer falls back to the object store after a failed sync)."""

    def __init__(self, model: nn.Module, fp8: bool = False):
        self.model, self.fp8 = model, fp8
        if fp8:
            from kernels.fp8 import expected_keys

            self.expected = expected_keys(model)
        else:
            self.expected = set(model.state_dict().keys())
        self.loaded: set[str] = set()

    @torch.no_grad()
    def load_part(self, part: dict[str, torch.Tensor]) -> None:
        """Load these tensors (name -> tensor, shapes as in the model's state dict) in place."""
        if self.fp8:
            from kernels.fp8 import requantize_model_

            requantize_model_(self.model, part, strict=True, allow_missing=True)
        else:
            result = self.model.load_state_dict(part, strict=False)
            if result.unexpected_keys:
                raise ValueError(f"weight load: unexpected keys {sorted(result.unexpected_keys)[:8]}")
        self.loaded.update(part)

    def finish(self) -> None:
        """Raise a ValueError naming the model's keys that no part delivered."""
        missing = sorted(self.expected - self.loaded)
        if missing:
            raise ValueError(f"weight load: {len(missing)} keys never arrived, e.g. {missing[:8]}")
