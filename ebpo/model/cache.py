"""Prefix KV cache for block-diffusion decoding.

Under the block-causal mask the keys/values of finished blocks never change (they cannot see later
blocks), so they are computed once and reused; each forward then runs only the active block(s).
Each batch row has its own committed length, so sequences with different prompt lengths, or that
finish blocks at different iterations, share one batch.

Flow per forward: the model calls `begin(rows)` once, `stage(layer, k, v)` per layer (the new tokens'
keys/values are kept as *pending*), and the caller decides afterwards with `commit(n)` how many of the
pending tokens become part of the prefix. `truncate` rewinds rows (Multi-Block Editing invalidation).

`StaticKVCache` is the fixed-shape variant for decode steps that are compiled or captured as a graph: no
host-side lengths, every forward writes its keys/values in place and attends the whole buffer through a mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CacheView:
    """What one forward sees of the cache: the rows it runs and the prefix length S it attends."""

    rows: torch.Tensor  # (b,) long row indices into the cache
    rows_list: list[int]
    prefix_len: int  # S = max committed length over `rows`
    valid: torch.Tensor  # (b, S) bool: True where the prefix key exists for that row
    contiguous: bool  # rows == range(B): plain slicing, no gather copy
    uniform: bool = False  # every row's committed length is S: the whole prefix is valid, no mask needed
    copies: int = 1  # rows == list(range(n)) * copies (n = b / copies): C copies of the first n rows


class BlockKVCache:
    """Preallocated per-layer K/V of shape (B, max_len, num_kv_heads, head_dim) with per-row lengths."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.batch_size = batch_size
        self.lengths: list[int] = [0] * batch_size  # host copy: no device sync to size a forward
        self._pending: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self._view: CacheView | None = None

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype=torch.float32, device=None) -> "BlockKVCache":
        """A cache sized for `config` (an LLaDA2MoeConfig)."""
        return cls(config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads,
                   config.head_dim, dtype=dtype, device=device)

    def begin(self, rows: torch.Tensor | list[int] | None, device=None) -> CacheView:
        """Start a forward over `rows` (default: all rows in order)."""
        rows_list = list(range(self.batch_size)) if rows is None else [int(r) for r in rows]
        device = device or self.k[0].device
        lens = [self.lengths[r] for r in rows_list]
        S = max(lens) if lens else 0
        valid = torch.arange(S, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        contiguous = rows_list == list(range(self.batch_size))
        self._view = CacheView(torch.tensor(rows_list, device=device, dtype=torch.long), rows_list, S, valid, contiguous,
                               uniform=all(n == S for n in lens), copies=_tiling(rows_list))
        self._pending = [None] * len(self.k)
        return self._view

    def prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed prefix K, V of the current view's rows: each (b, S, kv_heads, head_dim)."""
        view = self._view
        S = view.prefix_len
        if view.contiguous:
            return self.k[layer][:, :S], self.v[layer][:, :S]
        return self.k[layer][view.rows, :S], self.v[layer][view.rows, :S]

    def view_prefix_len(self) -> int:
        """S of the current forward (0 before any `begin`)."""
        return self._view.prefix_len if self._view is not None else 0

    def cascade(self, layer: int, keep: torch.Tensor | None):
        """Keys/values split for cascade attention over shared pages (`PagedKVCache.cascade`); a dense cache
        shares no storage between rows: None."""
        return None

    def shared_prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(K, V, C) when the view's rows are C copies of rows 0..n-1 whose prefixes are all whole (`uniform`):
        K, V (n, S, kv_heads, head_dim) are the n distinct prefixes, read in place (no gather), for attention
        that lets the C copies share them (`kernels.attention.copy_block_attention`). None otherwise."""
        view = self._view
        if view is None or not view.uniform or view.prefix_len == 0:
            return None
        n, S = len(view.rows_list) // view.copies, view.prefix_len
        if view.copies == 1 and view.rows_list != list(range(n)):
            return None
        return self.k[layer][:n, :S], self.v[layer][:n, :S], view.copies

    def stage(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Keep this forward's new keys/values (b, Lq, kv_heads, head_dim) until commit or next begin."""
        self._pending[layer] = (k_new.detach(), v_new.detach())

    def commit(self, num_tokens: int | list[int]) -> None:
        """Append the first `num_tokens` (per row, or one int for all) pending tokens to the prefix."""
        view = self._view
        if view is None or self._pending[0] is None:
            raise RuntimeError("BlockKVCache.commit: no forward has staged keys since begin()")
        b, Lq = self._pending[0][0].shape[:2]
        n = [num_tokens] * b if isinstance(num_tokens, int) else [int(x) for x in num_tokens]
        if len(n) != b or any(x < 0 or x > Lq for x in n):
            raise ValueError(f"BlockKVCache.commit: num_tokens must be {b} values in [0, {Lq}], got {num_tokens}")
        for i, r in enumerate(view.rows_list):
            if self.lengths[r] + n[i] > self.max_len:
                raise ValueError(f"BlockKVCache.commit: row {r} would exceed max_len={self.max_len}")
        dev = self.k[0].device
        n_t = torch.tensor(n, device=dev)
        src_i, src_j = torch.nonzero(torch.arange(Lq, device=dev)[None, :] < n_t[:, None], as_tuple=True)
        base = torch.tensor([self.lengths[r] for r in view.rows_list], device=dev)
        dst_rows = view.rows.to(dev)[src_i]
        dst_pos = base[src_i] + src_j
        for layer, (k_new, v_new) in enumerate(self._pending):
            self.k[layer][dst_rows, dst_pos] = k_new[src_i, src_j].to(self.k[layer].dtype)
            self.v[layer][dst_rows, dst_pos] = v_new[src_i, src_j].to(self.v[layer].dtype)
        for i, r in enumerate(view.rows_list):
            self.lengths[r] += n[i]

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Give row `dst` the first `num_tokens` committed keys/values of row `src` (a shared prompt: computed
        once, copied to every sequence that starts with it). Row `dst`'s length becomes `num_tokens`."""
        if not 0 <= num_tokens <= self.lengths[src]:
            raise ValueError(f"BlockKVCache.copy_prefix: row {src} holds {self.lengths[src]} tokens, asked {num_tokens}")
        for k, v in zip(self.k, self.v):
            k[dst, :num_tokens] = k[src, :num_tokens]
            v[dst, :num_tokens] = v[src, :num_tokens]
        self.lengths[dst] = num_tokens

    def truncate(self, rows: list[int], new_lengths: list[int]) -> None:
        """Forget everything past `new_lengths` for `rows` (used when an edit reaches back into the prefix)."""
        for r, n in zip(rows, new_lengths):
            if not 0 <= n <= self.lengths[r]:
                raise ValueError(f"BlockKVCache.truncate: row {r} length {self.lengths[r]} cannot become {n}")
            self.lengths[r] = n


class StaticKVCache:
    """Preallocated per-layer K/V (B, max_len, num_kv_heads, head_dim) for graph-captured decode steps.

    Nothing about it changes shape or lives on the host: before each forward the caller sets `write_pos`
    (B, Lq) long, the absolute slot of every new token; each layer scatters the new keys/values there and
    then attends the whole buffer through the keep-mask (B, 1, Lq, max_len) the caller passes as
    `attention_mask` (True = may attend; the mask, not a length, says which slots hold a valid prefix).
    Slots the mask never admits may hold anything (the decoder parks dummy tokens in a spare tail).
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.write_pos: torch.Tensor | None = None

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype=torch.float32, device=None) -> "StaticKVCache":
        """A cache sized for `config` (an LLaDA2MoeConfig)."""
        return cls(config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads, config.head_dim,
                   dtype=dtype, device=device)

    def row_view(self, row: int) -> "StaticKVCache":
        """A one-row cache sharing this cache's storage for `row` (writes through it land in this cache)."""
        view = StaticKVCache.__new__(StaticKVCache)
        view.k = [k[row:row + 1] for k in self.k]
        view.v = [v[row:row + 1] for v in self.v]
        view.max_len, view.write_pos = self.max_len, None
        return view

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter this forward's keys/values (B, Lq, kv_heads, head_dim) to `write_pos`; return the buffers."""
        idx = self.write_pos[:, :, None, None].expand(-1, -1, k_new.shape[2], k_new.shape[3])
        self.k[layer].scatter_(1, idx, k_new.detach().to(self.k[layer].dtype))
        self.v[layer].scatter_(1, idx, v_new.detach().to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]


def _tiling(rows: list[int]) -> int:
    """C when `rows` is list(range(n)) repeated C times (n >= 1), else 1."""
    if len(rows) < 2 or rows[0] != 0:
        return 1
    try:
        n = rows.index(0, 1)
    except ValueError:
        return 1
    if len(rows) % n or rows != list(range(n)) * (len(rows) // n):
        return 1
    return len(rows) // n
