"""Attention of rows that share a cached prefix, with the shared part computed once per group ("cascade" attention).

The G samples of one prompt (a GRPO group, `n` in a server request) reference the same prompt pages of a paged KV
cache. Plain attention gathers those keys once per row and scores every row against its own copy. Here a group's
queries are stacked and scored against the one shared copy in a single matrix product (part A). Each row's own
keys (its unshared cached positions and the new block) are scored with its keep-mask (part B). The two partial
softmaxes are merged exactly by their log-sum-exps:

    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B,   lse = logaddexp(lse_A, lse_B)

which is attention over the concatenated keys, up to float rounding. Scores are computed in float32 whatever the
input dtype. Part B always holds the query's own key (the keep-mask's diagonal), so its log-sum-exp is finite.

Shapes: B rows, L query positions, H query heads, Hkv key/value heads (H a multiple of Hkv; query head h reads
key/value head h // (H / Hkv), as `enable_gqa` does), D head size.
"""
from __future__ import annotations

import torch


# CPU's fused attention also returns each query's log-sum-exp, which the merge needs: one pass instead of a matrix
# product, an exp and a second product in Python (about 3x faster at decode sizes). A private op, hence the fallback.
_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float):
    """Attention of q (B, H, M, D) over k, v (B, H, N, D) with keep (B, 1, M, N) bool or None (all) ->
    (out (B, H, M, D) float32, lse (B, H, M) float32). Every query keeps a key (module docstring)."""
    q, k, v = q.float(), k.float(), v.float()
    # the fused op stops the process (SIGFPE) on zero queries: those take the plain products
    if _FUSED_CPU is not None and q.device.type == "cpu" and q.shape[-2] > 0:
        mask = None if keep is None else torch.zeros(keep.shape, dtype=q.dtype).masked_fill_(~keep, float("-inf"))
        out, lse = _FUSED_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - top)
    total = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, v) / total, (top + torch.log(total)).squeeze(-1)


def group_prefix_part(q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Part A of one group: q (n, L, H, D) of the group's rows over its shared keys/values (S, Hkv, D), every key
    visible to every query -> (out (n, L, H, D), lse (n, L, H)), both float32."""
    n, L, H, D = q.shape
    kv = k_shared.shape[1]
    rep = H // kv
    qg = q.reshape(n, L, kv, rep, D).permute(2, 0, 1, 3, 4).reshape(1, kv, n * L * rep, D)
    out, lse = _partial(qg, k_shared.permute(1, 0, 2)[None], v_shared.permute(1, 0, 2)[None], None, scale)
    out = out.reshape(kv, n, L, rep, D).permute(1, 2, 0, 3, 4).reshape(n, L, H, D)
    return out, lse.reshape(kv, n, L, rep).permute(1, 2, 0, 3).reshape(n, L, H)


def rows_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Part B: q (b, L, H, D) over each row's own keys/values k, v (b, N, Hkv, D) with keep (b, 1, L, N) bool ->
    (out (b, L, H, D), lse (b, L, H)), float32; scale 1/sqrt(D)."""
    b, L, H, D = q.shape
    kv = k.shape[2]
    rep = H // kv
    N = k.shape[1]
    qb = q.reshape(b, L, kv, rep, D).permute(0, 2, 3, 1, 4).reshape(b, kv, rep * L, D)  # rep-major queries
    kb, vb = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # (b, kv, N, D)
    keep = keep[:, :, None].expand(b, 1, rep, L, N).reshape(b, 1, rep * L, N)
    out, lse = _partial(qb, kb, vb, keep, D ** -0.5)
    out, lse = out.reshape(b, kv, rep, L, D), lse.reshape(b, kv, rep, L)
    return out.permute(0, 3, 1, 2, 4).reshape(b, L, H, D), lse.permute(0, 3, 1, 2).reshape(b, L, H)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial attentions over disjoint key sets -> attention over their union: outs (..., D), lses (...)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]


def cascade_attention(q: torch.Tensor, groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      rest_k: torch.Tensor, rest_v: torch.Tensor, rest_keep: torch.Tensor) -> torch.Tensor:
    """Attention of the rows of `q` (b, L, H, D) that form `groups`, in group order.

    groups: per group (rows (n,) long indices into q, shared keys (S_g, Hkv, D), shared values (S_g, Hkv, D));
    rest_k / rest_v (c, N, Hkv, D) and rest_keep (c, 1, L, N): each grouped row's own keys (its cached
    positions after the shared ones, then the new keys), in the order of the concatenated `rows`, c = sum n.
    Returns (c, L, H, D) in q's dtype, in that order."""
    D = q.shape[-1]
    rows = torch.cat([g[0] for g in groups])
    qc = q.index_select(0, rows)
    out_b, lse_b = rows_part(qc, rest_k, rest_v, rest_keep)
    outs, lses, at = [], [], 0
    for idx, ks, vs in groups:
        n = idx.numel()
        o, s = group_prefix_part(qc[at:at + n], ks, vs, D ** -0.5)
        outs.append(o)
        lses.append(s)
        at += n
    return merge(torch.cat(outs), torch.cat(lses), out_b, lse_b).to(q.dtype)
