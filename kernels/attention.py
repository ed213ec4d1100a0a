"""Block-causal attention: SDPA with an explicit boolean keep-mask, or FlexAttention with a BlockMask.

    attention(q (B, Hq, Lq, D), k, v (B, Hkv, Lk, D), keep_mask=None, *, block_mask=None, scale=None)

keep_mask is bool, broadcastable to (B, 1, Lq, Lk), True = may attend (the project-wide convention of
`ebpo.model.masks`); None = full attention, which is exactly what decoding the active block against a prefix
KV cache needs. GQA: Hq must be a multiple of Hkv. With a `block_mask` (from `flex_block_mask`) the call
goes to FlexAttention (compiled on CUDA; the eager reference implementation on CPU, which materialises the
scores and is for tests). Both give the same result for the same mask.

Mask kinds for `flex_block_mask(kind, seq_len, block_size, n_copies)`; `seq_len` is the length L of ONE
copy, the mask covers the whole layout:
  - "block_causal" (L x L):       token i attends j iff j // K <= i // K;
  - "noisy_clean"  (2L x 2L):     [noisy ; clean], = "packed" with n_copies = 1;
  - "packed"       ((N+1)L sq.):  [noisy_1 .. noisy_N ; clean]: noisy copy n, block b attends itself inside
                                   block b and clean blocks < b; clean block b attends clean blocks <= b;
                                   clean never attends noisy.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

KINDS = ("block_causal", "noisy_clean", "packed")
_compiled_flex = None


def mask_mod_for(kind: str, seq_len: int, block_size: int, n_copies: int = 1):
    """FlexAttention `mask_mod(b, h, q_idx, kv_idx) -> bool` for one of KINDS (see module docstring).

    Works on tensors and Python ints alike, so tests can evaluate it densely.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown mask kind {kind!r}; expected one of {KINDS}")
    if block_size <= 0 or seq_len <= 0:
        raise ValueError(f"seq_len and block_size must be positive, got {seq_len}, {block_size}")
    K, L = block_size, seq_len
    if kind == "block_causal":
        def block_causal(b, h, q_idx, kv_idx):
            return (kv_idx // K) <= (q_idx // K)
        return block_causal
    n = 1 if kind == "noisy_clean" else n_copies
    if n < 1:
        raise ValueError(f"n_copies must be >= 1, got {n_copies}")

    def packed(b, h, q_idx, kv_idx):
        qc, kc = q_idx // L, kv_idx // L  # copy index; n = the clean copy
        qb, kb = (q_idx % L) // K, (kv_idx % L) // K
        q_clean, k_clean = qc == n, kc == n
        same_noisy_block = (~q_clean) & (qc == kc) & (qb == kb)
        noisy_to_past_clean = (~q_clean) & k_clean & (kb < qb)
        clean_causal = q_clean & k_clean & (kb <= qb)
        return same_noisy_block | noisy_to_past_clean | clean_causal
    return packed


def layout_length(kind: str, seq_len: int, n_copies: int = 1) -> int:
    """Total sequence length the mask of `kind` covers (L, 2L or (N+1)L)."""
    return {"block_causal": seq_len, "noisy_clean": 2 * seq_len, "packed": (n_copies + 1) * seq_len}[kind]


def flex_block_mask(kind: str, seq_len: int, block_size: int, n_copies: int = 1, device=None):
    """FlexAttention BlockMask of `kind` over the whole layout (batch- and head-independent).

    seq_len: length L of one copy; device: where the mask lives (default: CUDA if available, else CPU).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    total = layout_length(kind, seq_len, n_copies)
    return create_block_mask(mask_mod_for(kind, seq_len, block_size, n_copies), None, None, total, total,
                             device=device)


def _flex(q, k, v, block_mask, scale, gqa):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # eager flex warns that it is unfused: expected off-GPU
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep_mask: torch.Tensor | None = None, *,
              block_mask=None, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention -> (B, Hq, Lq, D). See the module docstring for shapes and masks."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be 4-D (B, H, L, D), got {q.dim()}, {k.dim()}, {v.dim()}")
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % Hkv != 0 or v.shape[1] != Hkv:
        raise ValueError(f"attention: query heads ({Hq}) must be a multiple of kv heads ({Hkv}, v has {v.shape[1]})")
    if keep_mask is not None and block_mask is not None:
        raise ValueError("attention: pass either keep_mask (SDPA) or block_mask (FlexAttention), not both")
    if keep_mask is not None and keep_mask.dtype != torch.bool:
        raise ValueError(f"attention: keep_mask must be bool (True = may attend), got {keep_mask.dtype}")
    gqa = Hq != Hkv
    if block_mask is not None:
        return _flex(q, k, v, block_mask, scale, gqa)
    if gqa:  # repeat rather than enable_gqa: every SDPA backend and torch version accepts it
        rep = Hq // Hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep_mask, scale=scale)
