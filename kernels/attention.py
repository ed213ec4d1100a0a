"""Block-causal attention: SDPA with an explicit boolean keep-mask, or FlexAttention with a BlockMask.

    attention(q (B, Hq, Lq, D), k, v (B, Hkv, Lk, D), keep_mask=None, *, block_mask=None, scale=None)

keep_mask is bool, broadcastable to (B, 1, Lq, Lk), True = may attend (the project-wide convention of
`ebpo.model.masks`); None = full attention, which is exactly what decoding the active block against a prefix
KV cache needs. GQA: Hq must be a multiple of Hkv. With a `block_mask` (from `flex_block_mask`) the call
goes to FlexAttention (compiled on CUDA; the eager reference implementation on CPU, which materialises the
scores and is for tests). Both give the same result for the same mask.

`copy_block_attention` computes the `[noisy_1 .. noisy_N ; clean]` pattern (optionally after a cached clean
prefix) block by block without a mask, so no masked-out score is computed (on CPU, SDPA with a boolean mask
computes every score and throws most of them away).
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


def copy_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, copies: int, block_size: int,
                         k_prefix: torch.Tensor | None = None, v_prefix: torch.Tensor | None = None,
                         scale: float | None = None) -> torch.Tensor:
    """Block-sparse attention of the noisy/clean layout, computing only the scores the mask keeps.

    q (C*B, Hq, G*K, D), k/v (C*B, Hkv, G*K, D): C copies of B sequences (row c*B + b is copy c of
    sequence b; the last copy, c = C-1, is the clean one), each row holding the same G consecutive blocks
    of K tokens (the last one may be shorter). Optional k_prefix/v_prefix (B, Hkv, S, D): keys/values of
    the clean blocks before them (a KV cache), shared by the C copies of a sequence. A query of block g in row (c, b) attends
    [prefix of b ; clean blocks < g of b ; its own row's block g] - the `[noisy_1 .. noisy_N ; clean]`
    mask of `ebpo.model.masks.packed_noisy_clean_mask` (the clean copy's own block g is a clean block,
    so clean rows get the plain block-causal pattern). One SDPA call per block, no mask: the keys are
    concatenated rather than masked out, so no score is computed and thrown away. Returns like q.
    Differentiable (plain SDPA and concatenation).
    """
    CB, Hq, T, D = q.shape
    K = block_size
    if CB % copies:
        raise ValueError(f"copy_block_attention: {CB} rows is not a whole number of {copies} copies")
    B, G = CB // copies, -(-T // K)  # the last block may be partial (the sequence's end)
    gqa = Hq != k.shape[1]
    clean_k, clean_v = k[CB - B:], v[CB - B:]
    outs = []
    for g in range(G):
        lo, hi = g * K, min((g + 1) * K, T)
        pk = [k_prefix] if k_prefix is not None else []
        pv = [v_prefix] if v_prefix is not None else []
        if g:
            pk, pv = pk + [clean_k[:, :, :lo]], pv + [clean_v[:, :, :lo]]
        if pk:  # the sequence's visible clean prefix, repeated for its C copies, then each row's own block
            pk = torch.cat(pk, 2) if len(pk) > 1 else pk[0]
            pv = torch.cat(pv, 2) if len(pv) > 1 else pv[0]
            kk = torch.cat([pk.repeat(copies, 1, 1, 1), k[:, :, lo:hi]], 2)
            vv = torch.cat([pv.repeat(copies, 1, 1, 1), v[:, :, lo:hi]], 2)
        else:
            kk, vv = k[:, :, lo:hi], v[:, :, lo:hi]
        outs.append(F.scaled_dot_product_attention(q[:, :, lo:hi], kk, vv, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, 2) if G > 1 else outs[0]


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
