"""An independent, plain one-sequence, no-cache draft-and-edit decoder written from docs/background.md section 3.

Deliberately naive: python lists, one full forward over the canvas per iteration with the block-causal
mask of `ebpo.model.masks.block_causal_mask` (or, for an MBE pass, a mask built here with python loops),
per-position softmax/argmax. Greedy only. Returns the tokens plus the counts the decoder reports and a
few statistics proving that the interesting branches (M2T fallback, T2T edits, MBE edits) were taken.
"""
from __future__ import annotations

import torch

from ebpo.model.masks import block_causal_mask


def _eos_set(cfg):
    eos = cfg.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def _candidates(model, x, L, mask_fn, lo, hi, mask_id, penalty, lev_ids=None, eprob=None):
    keep = mask_fn(L)
    with torch.no_grad():
        logits = model(torch.tensor([x[:L]]), attention_mask=keep[None, None],
                       position_ids=torch.arange(L)[None]).logits[0]
    cand, prob = {}, {}
    for i in range(lo, hi):
        row = logits[i].double().clone()
        if penalty and i >= 1 and x[i - 1] != mask_id:
            row[x[i - 1]] -= penalty
        row[mask_id] = float("-inf")
        if lev_ids is not None:  # DELETE / INSERT priced before the penalty, then never a written token
            full = torch.softmax(logits[i].double().masked_fill(torch.arange(row.shape[0]) == mask_id, float("-inf")), -1)
            eprob[i] = (float(full[lev_ids[0]]), float(full[lev_ids[1]]))
            row[list(lev_ids)] = float("-inf")
        p = torch.softmax(row, -1)
        c = int(torch.argmax(p))
        cand[i], prob[i] = c, float(p[c])
    return cand, prob


def reference_decode(model, prompt, K, M, tau_mask, tau_edit, max_post_steps=16, num_to_transfer=1,
                     penalty=0.0, mbe_window=0, mbe_tau=0.9, mbe_max_passes=2, stop_at_eos=True,
                     tau_delete=None, tau_insert=None, max_lev_edits=2):
    cfg = model.config
    mask_id, eos = cfg.mask_token_id, _eos_set(cfg)
    editing = tau_edit is not None and tau_edit >= 0
    P = len(prompt)
    T = -(-(P + M) // K) * K
    x = list(prompt) + [mask_id] * (T - P)
    stats = dict(forwards=0, edits=0, mbe_edits=0, fallbacks=0, deletes=0, inserts=0)
    lev = any(t is not None and t >= 0 for t in (tau_delete, tau_insert))
    lev_ids = (cfg.delete_token_id, cfg.insert_token_id) if lev else None
    on_d = tau_delete is not None and tau_delete >= 0
    on_i = tau_insert is not None and tau_insert >= 0
    first = P // K
    b = first
    while True:
        post = iters = 0
        lo, hi = b * K, (b + 1) * K
        while True:
            eprob = {}
            cand, prob = _candidates(model, x, hi, lambda L: block_causal_mask(L, K), lo, hi, mask_id, penalty,
                                     lev_ids, eprob)
            stats["forwards"] += 1
            iters += 1
            ops = {}  # position -> "del" / "ins": the most confident max_lev_edits, one per position
            if lev and iters < K + max_post_steps + 1:  # from the forward cap on: no operation
                want = []
                for i in range(max(lo, P), hi):
                    if all(x[j] == mask_id for j in range(i, hi)):  # a [MASK] with only [MASK]s after it: no-op
                        continue
                    pd, pi = eprob[i]
                    if on_d and pd > tau_delete and pd >= (pi if on_i else -1.0):
                        want.append((-pd, i, "del"))
                    elif on_i and pi > tau_insert and pi > (pd if on_d else -1.0):
                        want.append((-pi, i, "ins"))
                ops = {i: op for _, i, op in sorted(want)[:max_lev_edits]}
            masks = [i for i in range(lo, hi) if i >= P and x[i] == mask_id]
            free = [i for i in masks if i not in ops]
            gamma = [i for i in free if prob[i] > tau_mask]
            if len(gamma) < num_to_transfer:
                if len(gamma) < len(free):
                    stats["fallbacks"] += 1
                gamma = sorted(free, key=lambda i: -prob[i])[:num_to_transfer]
            delta = []
            if editing:
                delta = [i for i in range(lo, hi)
                         if i >= P and i not in ops and x[i] != mask_id and cand[i] != x[i] and prob[i] > tau_edit]
            for i in gamma + delta:
                x[i] = cand[i]
            if ops:  # rebuild the block: DELETE drops x_i, INSERT puts a mask before it; pad or cut at the tail
                block = []
                for i in range(lo, hi):
                    if ops.get(i) == "ins":
                        block += [mask_id, x[i]]
                    elif ops.get(i) != "del":
                        block.append(x[i])
                x[lo:hi] = (block + [mask_id] * K)[:K]
                stats["deletes"] += sum(op == "del" for op in ops.values())
                stats["inserts"] += sum(op == "ins" for op in ops.values())
            stats["edits"] += len(delta) + len(ops)
            if not masks:
                post += 1
            left = sum(1 for i in range(lo, hi) if i >= P and x[i] == mask_id)
            if not masks and not delta and not ops:
                break
            if left == 0 and (post >= max_post_steps or not (editing or lev)):
                break
            if iters >= K + max_post_steps + 1 and left == 0:  # the cap never commits a [MASK]
                break
        if mbe_window and b > first:
            ws = max(first, b - mbe_window)

            def mbe_mask(L):
                g = [min(j // K, ws) for j in range(L)]
                return torch.tensor([[g[j] <= g[i] for j in range(L)] for i in range(L)])

            for _ in range(mbe_max_passes):
                cand, prob = _candidates(model, x, hi, mbe_mask, ws * K, hi, mask_id, penalty)
                stats["forwards"] += 1
                change = [i for i in range(ws * K, hi) if i >= P and cand[i] != x[i] and prob[i] > mbe_tau]
                for i in change:
                    x[i] = cand[i]
                stats["mbe_edits"] += len(change)
                stats["edits"] += len(change)
                if not change:
                    break
        region = x[P:min(P + M, hi)]
        if stop_at_eos and any(t in eos for t in region):
            break
        if b + 1 >= T // K:
            break
        b += 1
    out = x[P:P + M]
    for k, t in enumerate(out):
        if t in eos:
            out = out[: k + 1]
            break
    return out, stats
