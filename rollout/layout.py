"""Input layout of one batched decoder forward: which canvas slice each row runs, and its keep-mask.

Each row r runs the canvas slice [q_start_r, q_end_r) at its absolute positions:
  - with the prefix KV cache, q_start_r is the row's committed cache length, so the slice is the blocks
    still to commit (a finished block, the prompt's whole blocks on the first forward, or everything
    after an MBE edit) followed by the active block;
  - without the cache, q_start_r = 0 and the whole canvas up to the active block's end is recomputed;
  - in a Multi-Block Editing pass, q_start_r is the window's first position and the prefix is cut there.
Rows are right-padded to the longest slice. Attention follows "group" ids: a token may attend a key iff
group(key) <= group(query). The group is the block index, except that an MBE window's blocks all share
the window's first block index (one enlarged bidirectional block). Padding keys get group -1 (never
attended) and every query attends itself, so no attention row is empty.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ebpo.model.masks import block_causal_mask_from_positions


@dataclass
class Layout:
    """Tensors for one forward over b rows with L query slots and S cached prefix keys."""

    input_ids: torch.Tensor  # (b, L) long
    position_ids: torch.Tensor  # (b, L) long, absolute
    keep: torch.Tensor  # (b, 1, L, S + L) bool keep-mask
    valid: torch.Tensor  # (b, L) bool: real (non-padding) query slots


def build_layout(canvas: torch.Tensor, q_start: list[int], q_end: list[int], block_size: int,
                 clamp_group: list[int | None], prefix_len: int, mask_id: int) -> Layout:
    """Layout for rows whose canvases are `canvas` (b, T).

    q_start/q_end: per-row slice; clamp_group: per row None (plain blocks) or the MBE window's first
    block index; prefix_len: S, the number of cache slots the forward sees (0 without a cache). Prefix
    keys j of row r are attended iff j < q_start_r (slots past it are stale or belong to the window).
    """
    dev = canvas.device
    b, T = canvas.shape
    qs = torch.tensor(q_start, device=dev)
    qe = torch.tensor(q_end, device=dev)
    L = int((qe - qs).max())
    idx = qs[:, None] + torch.arange(L, device=dev)[None]
    valid = idx < qe[:, None]
    ids = canvas.gather(1, idx.clamp(max=T - 1)).masked_fill(~valid, mask_id)
    group = torch.div(idx, block_size, rounding_mode="floor")
    clamp = torch.tensor([c if c is not None else T for c in clamp_group], device=dev)
    group = torch.minimum(group, clamp[:, None])
    q_grp = group.masked_fill(~valid, -1)
    j = torch.arange(prefix_len, device=dev)[None].expand(b, prefix_len)
    k_prefix = torch.div(j, block_size, rounding_mode="floor").masked_fill(j >= qs[:, None], -1)
    k_grp = torch.cat([k_prefix, q_grp], dim=1)
    # block size 1 on group ids: keep iff group(key) <= group(query) and the key is real
    keep = block_causal_mask_from_positions(q_grp, k_grp, 1)
    eye = torch.eye(L, dtype=torch.bool, device=dev)
    keep[..., prefix_len:] |= eye
    return Layout(input_ids=ids, position_ids=idx, keep=keep, valid=valid)


def gather_span(hidden: torch.Tensor, offsets: list[int], length: int) -> torch.Tensor:
    """hidden (b, L, H) -> (b, length, H): row i's slots offsets[i] .. offsets[i] + length - 1."""
    if len(offsets) != hidden.shape[0]:
        raise ValueError(f"gather_span: {len(offsets)} offsets for {hidden.shape[0]} rows")
    off = torch.tensor(offsets, device=hidden.device)
    idx = off[:, None] + torch.arange(length, device=hidden.device)[None]
    return hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
