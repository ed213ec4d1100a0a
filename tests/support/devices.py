"""The device rule checked on a CPU-only machine: a function that makes tensors must put them on its inputs' (or
its generator's) device, never on torch's default device. Run it under a `meta` default device with CPU inputs: a
tensor made on the default device lands on `meta` and fails where it meets the CPU ones, while correct code returns
exactly what it returns without the context."""
import contextlib

import torch

from ebpo.core.likelihood import NoiseDraws


def under_default(default_device):
    """`with under_default(None)`: nothing changes; `with under_default("meta")`: torch's default device is `meta`."""
    return torch.device(default_device) if default_device else contextlib.nullcontext()


def assert_same(want, got):
    """`got` (a tensor, NoiseDraws, dict or None) equals `want` exactly, every tensor on the CPU with want's dtype."""
    if isinstance(want, torch.Tensor):
        assert got.device.type == "cpu" and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, NoiseDraws):
        for f in ("masked", "t", "weight", "substituted", "sub_ids", "noisy_ids", "targets"):
            assert_same(getattr(want, f), getattr(got, f))
    elif isinstance(want, dict):
        assert got == want
    else:
        assert want is None and got is None
