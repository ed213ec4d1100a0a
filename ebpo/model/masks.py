"""Boolean attention keep-masks for block diffusion, built in exactly one place.

Convention everywhere in ebpo: a mask is a `torch.bool` tensor where **True means "may attend"**.
Models convert it once (in `ebpo.model`) to whatever the attention kernel wants; nothing else in the
project builds additive 0/-inf masks (docs/background.md section 1 describes the bug that mixing the two causes).

Block causality (docs/background.md section 2): token i may attend token j iff block(j) <= block(i), where
block(p) = p // block_size for absolute positions p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def block_ids(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block index of each absolute position: `positions // block_size` (same shape, long)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    return torch.div(positions, block_size, rounding_mode="floor")


def block_causal_mask(seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """(seq_len, seq_len) bool keep-mask: bidirectional inside a block, causal across blocks."""
    blk = block_ids(torch.arange(seq_len, device=device), block_size)
    return blk[None, :] <= blk[:, None]


def block_causal_mask_from_positions(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keep-mask from absolute position ids: q_pos (B, Lq), k_pos (B, Lk) -> (B, 1, Lq, Lk) bool.

    Used when queries and keys are not a contiguous range (decoding against a prefix cache, several
    active blocks at once). Positions < 0 mark padding keys, which nobody attends.
    """
    qb = block_ids(q_pos, block_size)[:, :, None]
    kb = block_ids(k_pos.clamp(min=0), block_size)[:, None, :]
    keep = (kb <= qb) & (k_pos >= 0)[:, None, :]
    return keep[:, None]


def noisy_clean_mask(length: int, block_size: int, device=None) -> torch.Tensor:
    """(2L, 2L) keep-mask for the vectorized training layout `[noisy copy ; clean copy]`.

    Noisy block b attends noisy block b (bidirectional) and clean blocks < b; clean block b attends
    clean blocks <= b; clean never attends noisy. Position ids for this layout repeat 0..L-1 twice.
    """
    return packed_noisy_clean_mask(length, block_size, n_copies=1, device=device)


def packed_noisy_clean_mask(length: int, block_size: int, n_copies: int, device=None) -> torch.Tensor:
    """((N+1)L, (N+1)L) keep-mask for `[noisy_1 ; ... ; noisy_N ; clean]` sharing one clean copy.

    Each noisy copy n attends only itself inside its own block plus the shared clean blocks before it,
    so every copy's logits equal those of the unpacked `[noisy_n ; clean]` layout (docs/background.md section 8).
    """
    if n_copies < 1:
        raise ValueError(f"n_copies must be >= 1, got {n_copies}")
    L = length
    total = (n_copies + 1) * L
    idx = torch.arange(total, device=device)
    copy = torch.div(idx, L, rounding_mode="floor")  # 0..N-1 noisy copies, N = clean
    blk = block_ids(idx % L, block_size)
    is_clean = copy == n_copies
    qc, kc = copy[:, None], copy[None, :]
    qb, kb = blk[:, None], blk[None, :]
    q_clean, k_clean = is_clean[:, None], is_clean[None, :]
    same_noisy_block = (~q_clean) & (qc == kc) & (qb == kb)
    noisy_to_clean_past = (~q_clean) & k_clean & (kb < qb)
    clean_to_clean = q_clean & k_clean & (kb <= qb)
    return same_noisy_block | noisy_to_clean_past | clean_to_clean


def noisy_clean_position_ids(length: int, n_copies: int = 1, device=None) -> torch.Tensor:
    """Position ids `[0..L-1] * (n_copies + 1)` for the (packed) training layout, shape ((N+1)L,)."""
    return torch.arange(length, device=device).repeat(n_copies + 1)


def padding_to_block_causal(padding_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """2-D padding mask (B, L) with 1 = real token -> (B, 1, L, L) block-causal keep-mask.

    Padding keys are dropped; every query keeps itself so that a padding query row is never empty
    (an all-False row makes SDPA return NaN, which would then leak through later layers' residuals).
    """
    B, L = padding_mask.shape
    keep = block_causal_mask(L, block_size, device=padding_mask.device)[None] & padding_mask.bool()[:, None, :]
    keep = keep | torch.eye(L, dtype=torch.bool, device=padding_mask.device)[None]
    return keep[:, None]


@dataclass(frozen=True)
class CopyBlockLayout:
    """A structured keep-mask, passed as `attention_mask` instead of a dense one: the input (C*B, G*K)
    holds C copies of B sequences (row c*B + b is copy c of sequence b; the last copy is the clean one),
    each row the same G consecutive blocks of K tokens. A token of block g in row (c, b) may attend the
    cached clean prefix of sequence b (with `cache=`: rows `list(range(B)) * C`, every committed
    length equal), the clean blocks < g of b, and its own row's block g. This is the mask of
    `packed_noisy_clean_mask` (noisy copies see past clean blocks and their own block; the clean copy is
    block-causal) restricted to G blocks, and the model computes it without wasted scores
    (`kernels.attention.copy_block_attention`). With C = 1 it is the plain block-causal mask.
    """

    copies: int
    block_size: int
