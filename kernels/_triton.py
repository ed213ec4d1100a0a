"""Guarded Triton import and the single dispatch rule shared by every kernel.

`import kernels` must work where triton is missing or broken (CPU wheels, macOS): every kernel module
imports `triton` / `tl` from here and only defines its `@triton.jit` functions when `HAS_TRITON`.
"""
from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the installation
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a triton that fails to initialise without a driver
    triton = None
    tl = None
    HAS_TRITON = False

# Triton's interpreter runs kernels on CPU tensors (slowly); tests use it to check kernel logic without a GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """Decide the backend for an op on `tensors`.

    backend: "auto" -> Triton iff triton imports and every tensor is on CUDA (or the interpreter is on);
    "triton" -> Triton or a clear error; "torch" -> the exact torch fallback.
    """
    if backend == "torch":
        return False
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    ok = HAS_TRITON and (INTERPRET or all(t.is_cuda for t in tensors))
    if backend == "triton" and not ok:
        why = "triton is not importable" if not HAS_TRITON else "tensors are not on CUDA (set TRITON_INTERPRET=1 for CPU)"
        raise RuntimeError(f"backend='triton' requested but {why}")
    return ok
