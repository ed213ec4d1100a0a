"""Kernels for ebpo: per-block FP8 linear layers, the fused decode step, memory-light token log-probs and
block-causal attention.

Every public op has an exact torch fallback (CPU and GPU); Triton kernels are used only for CUDA tensors
when `triton` imports (or under `TRITON_INTERPRET=1`, which runs them on CPU for testing). This package
imports nothing else of ours. Submodules: `kernels.fp8`, `kernels.decode`, `kernels.logprobs`,
`kernels.attention`.
"""
from ._triton import HAS_TRITON, use_triton

__all__ = ["HAS_TRITON", "use_triton"]
