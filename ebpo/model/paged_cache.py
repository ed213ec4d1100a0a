"""`PagedKVCache`: the prefix KV cache of decoding in block-sized pages that rows reference, so that memory
follows the live tokens and a shared prompt is held once.

`BlockKVCache` keeps `batch_size x max_len` positions whatever each row holds: a long-lived engine whose canvas is
sized for its longest sequence pays that for every slot. Here each layer's keys/values live in a pool of pages of
`page` positions (the decoder's block size); a row holds a page table. A page is taken when a commit reaches it
and given back when its last reader truncates below it or is freed, so the pool holds what the rows hold, rounded
up to a page each. `copy_prefix` makes a row *reference* another row's whole pages (a shared prompt, counted once);
a commit into a page another row also reads copies it first, so a reader never sees a write of its neighbour.

The model sees the same interface as `BlockKVCache` (begin / prefix / stage / commit / truncate), and the same
numbers: `prefix` gathers each row's pages into the (b, S, kv_heads, head_dim) layout attention reads.

Rows that reference the same leading pages (the samples of one prompt) are also offered to attention as groups
(`cascade`): a group's shared keys are gathered once and its queries scored against them together
(`kernels.cascade`), so a shared prompt is read once per forward as well as stored once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ebpo.model.cache import BlockKVCache, CacheView


@dataclass
class CascadePlan:
    """How one forward's rows split into groups that share leading pages, and the rest (view row indices).

    groups: per group (rows (n,) long, flat pool positions of its shared keys (S_g,) long); rows: the grouped
    rows in group order (c,); rest_index (c, R) flat pool positions of each grouped row's cached positions after
    its shared ones (padding: any position, masked); rest_keep (c, 1, L, R + L) bool, the keep-mask over them and
    the new keys; plain: the rows in no group (p,)."""
    groups: list
    rows: torch.Tensor
    rest_index: torch.Tensor
    rest_keep: torch.Tensor
    plain: torch.Tensor


@dataclass
class CascadeInputs:
    """One layer's keys/values for `kernels.cascade.cascade_attention` (grouped rows) and plain attention (the
    rest): groups (rows, shared K (S_g, kv, D), shared V); rest_k / rest_v (c, R + L, kv, D) with rest_keep;
    plain_k / plain_v (p, S, kv, D), the committed prefixes of the plain rows (None when there are none)."""
    groups: list
    rows: torch.Tensor
    rest_k: torch.Tensor
    rest_v: torch.Tensor
    rest_keep: torch.Tensor
    plain: torch.Tensor
    plain_k: torch.Tensor | None
    plain_v: torch.Tensor | None


class PagedKVCache(BlockKVCache):
    """Keys/values of `num_layers` layers in pages of `page` positions (module docstring).

    The pool starts at `initial_pages` and grows by a quarter (at least what is asked) when a commit finds no free
    page. Counters: `pages_in_use`, `peak_pages` (most pages in use at once), `pool_pages` (allocated)."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 page: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 initial_pages: int = 0, cascade_min_shared: int = 128, cascade_ratio: float = 4.0):
        self.page, self.max_len, self.batch_size = int(page), max_len, batch_size
        # `cascade` groups rows whose shared keys are at least this many, and `cascade_ratio` x their own ones
        self.cascade_min_shared, self.cascade_ratio = int(cascade_min_shared), float(cascade_ratio)
        self._shape, self._dtype, self._device = (num_kv_heads, head_dim), dtype, device
        n = max(1, int(initial_pages))
        self.k = [torch.zeros((n, self.page, num_kv_heads, head_dim), dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.refs = [0] * n  # readers per page
        self.free_pages = list(range(n - 1, -1, -1))
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.lengths: list[int] = [0] * batch_size
        self._pending: list = [None] * num_layers
        self._view: CacheView | None = None
        self._index: torch.Tensor | None = None
        self._plan_for: torch.Tensor | None = None  # the keep-mask `_plan` was made for (one per forward)
        self._plan: CascadePlan | None = None
        self.peak_pages = 0

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype=torch.float32, device=None,
                  page: int | None = None) -> "PagedKVCache":
        """A cache for `config` (an LLaDA2MoeConfig) in pages of `page` positions (default its block size)."""
        return cls(config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads, config.head_dim,
                   page or config.block_size, dtype=dtype, device=device)

    # ---- accounting
    @property
    def pool_pages(self) -> int:
        return len(self.refs)

    @property
    def pages_in_use(self) -> int:
        return self.pool_pages - len(self.free_pages)

    def page_bytes(self) -> int:
        """Bytes of one page over every layer, keys and values."""
        k = self.k[0]
        return 2 * len(self.k) * k[0].numel() * k.element_size()

    # ---- pages
    def _take(self) -> int:
        if not self.free_pages:
            self._grow(max(1, self.pool_pages // 4))
        p = self.free_pages.pop()
        self.refs[p] = 1
        self.peak_pages = max(self.peak_pages, self.pages_in_use)
        return p

    def _grow(self, extra: int) -> None:
        n = self.pool_pages
        for i in range(len(self.k)):
            self.k[i] = torch.cat([self.k[i], self.k[i].new_zeros((extra, *self.k[i].shape[1:]))])
            self.v[i] = torch.cat([self.v[i], self.v[i].new_zeros((extra, *self.v[i].shape[1:]))])
        self.refs += [0] * extra
        self.free_pages += list(range(n + extra - 1, n - 1, -1))

    def _drop(self, p: int) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:
            self.free_pages.append(p)

    def _own(self, row: int, i: int) -> int:
        """Page i of `row`, copied first when another row reads it too (copy on write)."""
        p = self.tables[row][i]
        if self.refs[p] > 1:
            q = self._take()
            for k, v in zip(self.k, self.v):
                k[q], v[q] = k[p], v[p]
            self._drop(p)
            self.tables[row][i] = p = q
        return p

    # ---- the BlockKVCache interface
    def begin(self, rows, device=None) -> CacheView:
        view = super().begin(rows, device)
        view.contiguous = False  # pages: always gathered
        S, P = view.prefix_len, self.page
        dev = self.k[0].device
        idx = torch.zeros((len(view.rows_list), S), dtype=torch.long, device=dev)
        for i, r in enumerate(view.rows_list):
            n = self.lengths[r]
            if n:
                pages = torch.tensor(self.tables[r][: -(-n // P)], dtype=torch.long, device=dev)
                idx[i, :n] = (pages[:, None] * P + torch.arange(P, device=dev)).reshape(-1)[:n]
        self._index = idx
        self._plan_for = self._plan = None
        return view

    def prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = self._index.reshape(-1)
        b, S = self._index.shape
        k = self.k[layer].reshape(-1, *self._shape).index_select(0, flat).reshape(b, S, *self._shape)
        v = self.v[layer].reshape(-1, *self._shape).index_select(0, flat).reshape(b, S, *self._shape)
        return k, v

    def shared_prefix(self, layer: int):
        return None  # the copy-block layout of the learner reads a BlockKVCache

    def cascade(self, layer: int, keep: torch.Tensor | None) -> CascadeInputs | None:
        """This forward's keys/values of `layer` split for cascade attention (`CascadeInputs`), or None when no
        two rows share a visible leading page. keep: the forward's keep-mask (b, 1, L, S + L); call after
        `stage(layer, ...)`: the new keys are read from it."""
        if keep is not self._plan_for:
            self._plan_for, self._plan = keep, self._make_plan(keep)
        plan = self._plan
        if plan is None:
            return None
        kv, D = self._shape
        pk, pv = self.k[layer].reshape(-1, kv, D), self.v[layer].reshape(-1, kv, D)
        k_new, v_new = self._pending[layer]
        c, R = plan.rest_index.shape
        flat = plan.rest_index.reshape(-1)
        rest_k = torch.cat([pk.index_select(0, flat).reshape(c, R, kv, D).to(k_new.dtype), k_new[plan.rows]], 1)
        rest_v = torch.cat([pv.index_select(0, flat).reshape(c, R, kv, D).to(v_new.dtype), v_new[plan.rows]], 1)
        groups = [(rows, pk.index_select(0, idx), pv.index_select(0, idx)) for rows, idx in plan.groups]
        plain_k = plain_v = None
        if plan.plain.numel():
            idx = self._index[plan.plain]
            p, S = idx.shape
            plain_k = pk.index_select(0, idx.reshape(-1)).reshape(p, S, kv, D)
            plain_v = pv.index_select(0, idx.reshape(-1)).reshape(p, S, kv, D)
        return CascadeInputs(groups, plan.rows, rest_k, rest_v, plan.rest_keep, plan.plain, plain_k, plain_v)

    def _make_plan(self, keep: torch.Tensor | None) -> CascadePlan | None:
        """Group the view's rows by shared leading pages that every query of every member sees (module docstring);
        None when there is no group of two rows sharing a page or more."""
        view, P = self._view, self.page
        S = view.prefix_len if view is not None else 0
        if keep is None or S < P or keep.dim() != 4 or keep.shape[0] != len(view.rows_list):
            return None
        rows = view.rows_list
        # prefix positions every query of the row sees, counted from 0 (padded queries see none)
        lead = keep[:, 0, :, :S].all(dim=1).int().cumprod(dim=1).sum(dim=1).tolist()
        by_first: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if min(self.lengths[r], lead[i]) >= P:
                by_first.setdefault(self.tables[r][0], []).append(i)
        L = keep.shape[2]
        groups, members, shared, own = [], [], [], []
        for found in by_first.values():
            if len(found) < 2:
                continue
            first = self.tables[rows[found[0]]]
            pages = min(_common(first, self.tables[rows[i]], self.lengths[rows[i]] // P) for i in found)
            n = min([pages * P] + [lead[i] for i in found])
            # a row gains when its shared keys outnumber its own: scoring those is the slower part here
            found = [i for i in found if n >= self.cascade_ratio * (min(self.lengths[rows[i]], S) - n + L)]
            if len(found) < 2 or n < max(P, self.cascade_min_shared):
                continue
            idx = (torch.tensor(first[:-(-n // P)], dtype=torch.long, device=keep.device)[:, None] * P
                   + torch.arange(P, device=keep.device)).reshape(-1)[:n]
            groups.append((torch.tensor(found, dtype=torch.long, device=keep.device), idx))
            members += found
            shared += [n] * len(found)
            own += [max(0, min(self.lengths[rows[i]], S) - n) for i in found]
        if not groups:
            return None
        dev = keep.device
        R = max(own)  # keys past a row's own length are masked: the rest stops at the longest row's
        pos = torch.tensor(shared, device=dev)[:, None] + torch.arange(R, device=dev)[None]  # (c, R)
        inside = pos < S
        pos = pos.clamp(max=S - 1)
        m = torch.tensor(members, dtype=torch.long, device=dev)
        rest_index = self._index[m].gather(1, pos)
        k_rest = keep[m][:, :, :, :S].gather(3, pos[:, None, None, :].expand(-1, 1, L, -1)) & inside[:, None, None, :]
        rest_keep = torch.cat([k_rest, keep[m][:, :, :, S:]], dim=3)
        plain = torch.tensor([i for i in range(len(rows)) if i not in set(members)], dtype=torch.long, device=dev)
        return CascadePlan(groups, m, rest_index, rest_keep, plain)

    def commit(self, num_tokens: int | list[int]) -> None:
        view = self._view
        if view is None or self._pending[0] is None:
            raise RuntimeError("PagedKVCache.commit: no forward has staged keys since begin()")
        b, Lq = self._pending[0][0].shape[:2]
        n = [num_tokens] * b if isinstance(num_tokens, int) else [int(x) for x in num_tokens]
        if len(n) != b or any(x < 0 or x > Lq for x in n):
            raise ValueError(f"PagedKVCache.commit: num_tokens must be {b} values in [0, {Lq}], got {num_tokens}")
        P, src, dst = self.page, [], []
        for i, r in enumerate(view.rows_list):
            if self.lengths[r] + n[i] > self.max_len:
                raise ValueError(f"PagedKVCache.commit: row {r} would exceed max_len={self.max_len}")
            for j in range(n[i]):
                pos = self.lengths[r] + j
                while len(self.tables[r]) <= pos // P:
                    self.tables[r].append(self._take())
                page = self._own(r, pos // P) if j == 0 or pos % P == 0 else self.tables[r][pos // P]
                src.append((i, j))
                dst.append(page * P + pos % P)
            self.lengths[r] += n[i]
        if not dst:
            return
        dev = self.k[0].device
        si = torch.tensor([s[0] for s in src], device=dev)
        sj = torch.tensor([s[1] for s in src], device=dev)
        d = torch.tensor(dst, device=dev)
        for layer, (k_new, v_new) in enumerate(self._pending):
            self.k[layer].reshape(-1, *self._shape)[d] = k_new[si, sj].to(self.k[layer].dtype)
            self.v[layer].reshape(-1, *self._shape)[d] = v_new[si, sj].to(self.v[layer].dtype)

    def truncate(self, rows: list[int], new_lengths: list[int]) -> None:
        """Forget everything past `new_lengths` for `rows`; pages nobody reads any more go back to the pool."""
        for r, n in zip(rows, new_lengths):
            if not 0 <= n <= self.lengths[r]:
                raise ValueError(f"PagedKVCache.truncate: row {r} length {self.lengths[r]} cannot become {n}")
            keep = -(-n // self.page)
            for p in self.tables[r][keep:]:
                self._drop(p)
            del self.tables[r][keep:]
            self.lengths[r] = n

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Row `dst` reads the first `num_tokens` (whole pages) of row `src`: its pages are referenced, not copied."""
        if not 0 <= num_tokens <= self.lengths[src]:
            raise ValueError(f"PagedKVCache.copy_prefix: row {src} holds {self.lengths[src]} tokens, "
                             f"asked {num_tokens}")
        if num_tokens % self.page:
            raise ValueError(f"PagedKVCache.copy_prefix: {num_tokens} tokens is not a whole number of "
                             f"{self.page}-token pages")
        self.truncate([dst], [0])
        shared = self.tables[src][: num_tokens // self.page]
        for p in shared:
            self.refs[p] += 1
        self.tables[dst] = list(shared)
        self.lengths[dst] = num_tokens


def _common(a: list[int], b: list[int], limit: int) -> int:
    """Leading entries a and b share, at most `limit`."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:  # the usual case (references of one prompt's pages): one list comparison
        return limit
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
