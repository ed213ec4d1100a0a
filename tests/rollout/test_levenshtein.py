"""`rollout.levenshtein`'s block step against a plain per-row loop of the rules in its module docstring: which
positions take DELETE / INSERT (strict thresholds, the likelier operation, the most confident `max_lev_edits`, never
on the prompt, on trailing [MASK]s or past the forward cap), the ordinary draft-and-edit step on the others, the
shifted block, where written tokens and traces land, and the edit log. Random blocks on a probability grid that
holds the thresholds themselves, so ties occur."""
import random
from types import SimpleNamespace

import pytest
import torch

from ebpo.core.levenshtein import DEL, INS, KEEP, SUB
from rollout.levenshtein import edit_probs, edit_sets, lev_log, levenshtein_block_step, noop_positions, shift_trace

MASK, DEL_ID, INS_ID = 1, 90, 91
GRID = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]


def _on(tau):
    return tau is not None and tau >= 0


def _stable_top(conf, n):
    """Indices of the n largest values of `conf`, ties in index order (a stable descending sort)."""
    return set(sorted(range(len(conf)), key=lambda i: -conf[i])[:n])


def _emit(values, ops, ins_value, K, pad):
    """Position i emits nothing (DEL), values[i] (KEEP / SUB) or (ins_value, values[i]) (INS); padded / cut to K."""
    out = []
    for v, op in zip(values, ops):
        if op == INS:
            out.append(ins_value)
        if op != DEL:
            out.append(v)
    return (out + [pad] * K)[:K]


def _reference_row(tok, prob, ep, cur, prot, cfg, allowed):
    K = len(cur)
    noop = [all(c == MASK for c in cur[i:]) for i in range(K)]
    blocked = [prot[i] or noop[i] or not allowed for i in range(K)]
    pd = [e[0] if _on(cfg.tau_delete) else -1.0 for e in ep]
    pi = [e[1] if _on(cfg.tau_insert) else -1.0 for e in ep]
    want_d = [pd[i] > (cfg.tau_delete or 0.0) and pd[i] >= pi[i] and not blocked[i] for i in range(K)]
    want_i = [pi[i] > (cfg.tau_insert or 0.0) and pi[i] > pd[i] and not blocked[i] for i in range(K)]
    conf = [pd[i] if want_d[i] else pi[i] if want_i[i] else float("-inf") for i in range(K)]
    top = _stable_top(conf, cfg.max_lev_edits)
    dele = [want_d[i] and i in top for i in range(K)]
    ins = [want_i[i] and i in top for i in range(K)]
    prot2 = [prot[i] or dele[i] or ins[i] for i in range(K)]
    is_mask = [cur[i] == MASK and not prot2[i] for i in range(K)]
    passing = [is_mask[i] and prob[i] > cfg.tau_mask for i in range(K)]
    if sum(passing) < cfg.num_to_transfer:
        first = _stable_top([prob[i] if is_mask[i] else float("-inf") for i in range(K)], cfg.num_to_transfer)
        passing = [is_mask[i] and i in first for i in range(K)]
    m2t = passing
    t2t = [_on(cfg.tau_edit) and not is_mask[i] and not prot2[i] and tok[i] != cur[i] and prob[i] > cfg.tau_edit
           for i in range(K)]
    tokens = [tok[i] if m2t[i] or t2t[i] else cur[i] for i in range(K)]
    ops = [DEL if dele[i] else INS if ins[i] else SUB if m2t[i] or t2t[i] else KEEP for i in range(K)]
    new = _emit(tokens, ops, MASK, K, MASK)
    return dict(ops=ops, new=new, m2t=m2t, t2t=[t2t[i] or dele[i] or ins[i] for i in range(K)], tokens=tokens,
                filled=_emit(m2t, ops, False, K, False), rewritten=_emit(t2t, ops, False, K, False),
                had_masks=any(cur[i] == MASK and not prot[i] for i in range(K)),
                masks_left=sum(new[i] == MASK and not prot[i] for i in range(K)), base_t2t=t2t)


def _case(seed, B=96, K=6):
    rng = random.Random(seed)
    cfg = SimpleNamespace(tau_mask=rng.choice([0.3, 0.5]), tau_edit=rng.choice([None, -1.0, 0.5, 0.7]),
                          num_to_transfer=rng.choice([1, 2]), tau_delete=rng.choice([None, -1.0, 0.0, 0.3, 0.5]),
                          tau_insert=rng.choice([None, -1.0, 0.0, 0.3, 0.5]), max_lev_edits=rng.choice([1, 2, K]))
    cur = [[rng.choice([MASK, MASK, 3, 4, 5]) for _ in range(K)] for _ in range(B)]
    for b in range(0, B, 5):  # a tail of [MASK]s: the no-op positions
        n = rng.randint(1, K)
        cur[b][K - n:] = [MASK] * n
    tok = [[rng.choice([3, 4, 5, 6]) for _ in range(K)] for _ in range(B)]
    prob = [[rng.choice(GRID) for _ in range(K)] for _ in range(B)]
    ep = [[[rng.choice(GRID), rng.choice(GRID)] for _ in range(K)] for _ in range(B)]
    start = [rng.choice([0, 0, 1, 3]) for _ in range(B)]
    prot = [[i < start[b] for i in range(K)] for b in range(B)]
    allowed = [rng.random() < 0.8 for _ in range(B)]
    return cfg, cur, tok, prob, ep, prot, allowed


@pytest.mark.parametrize("seed", range(16))
def test_levenshtein_block_step_matches_a_plain_loop(seed):
    cfg, cur, tok, prob, ep, prot, allowed = _case(seed, K=6 if seed % 2 else 32)
    T = torch.tensor
    use_allowed = seed % 4 != 0  # ops_allowed None: every row may take operations
    st = levenshtein_block_step(T(tok), T(prob), T(ep), T(cur), T(prot), MASK, cfg,
                                ops_allowed=T(allowed) if use_allowed else None)
    for b in range(len(cur)):
        ref = _reference_row(tok[b], prob[b], ep[b], cur[b], prot[b], cfg, allowed[b] or not use_allowed)
        assert st.ops[b].tolist() == ref["ops"], b
        assert st.result.new[b].tolist() == ref["new"]
        assert st.result.m2t[b].tolist() == ref["m2t"] and st.result.t2t[b].tolist() == ref["t2t"]
        assert st.tokens[b].tolist() == ref["tokens"]
        assert st.filled[b].tolist() == ref["filled"] and st.rewritten[b].tolist() == ref["rewritten"]
        assert st.written[b].tolist() == [f or r for f, r in zip(ref["filled"], ref["rewritten"])]
        assert bool(st.result.had_masks[b]) == ref["had_masks"] and int(st.result.masks_left[b]) == ref["masks_left"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("K", [6, 32])
def test_edit_sets_match_a_plain_loop(seed, K):
    """K = 32 (the released models' block): many tied confidences, of which the earliest positions win; a sort
    that is not stable reorders ties at that size."""
    cfg, cur, tok, prob, ep, prot, allowed = _case(100 + seed, K=K)
    dele, ins = edit_sets(torch.tensor(ep), torch.tensor(prot), cfg.tau_delete, cfg.tau_insert, cfg.max_lev_edits)
    for b in range(len(cur)):
        nothing = [False] * len(cur[b])
        ref = _reference_row(tok[b], prob[b], ep[b], nothing, prot[b], cfg, True)  # no [MASK]: no no-op position
        assert [o == DEL for o in ref["ops"]] == dele[b].tolist()
        assert [o == INS for o in ref["ops"]] == ins[b].tolist()


def test_noop_positions_are_the_trailing_masks():
    cur = torch.tensor([[3, MASK, 4, MASK, MASK], [MASK] * 5, [3, 4, 5, 6, 7], [MASK, 3, MASK, 3, MASK]])
    want = [[False, False, False, True, True], [True] * 5, [False] * 5, [False, False, False, False, True]]
    assert noop_positions(cur, MASK).tolist() == want


@pytest.mark.parametrize("seed", range(6))
def test_shift_trace_and_lev_log_follow_the_tokens(seed):
    """Traces move with their tokens (-1 on inserted and tail slots), written slots get this forward; the log
    lists, in position order, every T2T rewrite (old, new token) and every DELETE / INSERT (old, its id)."""
    cfg, cur, tok, prob, ep, prot, allowed = _case(200 + seed, B=48)
    T = torch.tensor
    st = levenshtein_block_step(T(tok), T(prob), T(ep), T(cur), T(prot), MASK, cfg)
    K = len(cur[0])
    trace = torch.randint(0, 9, (len(cur), K), generator=torch.Generator().manual_seed(seed))
    fwd = torch.arange(100, 100 + len(cur))[:, None]
    got = shift_trace(trace, st, fwd)
    for b in range(len(cur)):
        ref = _reference_row(tok[b], prob[b], ep[b], cur[b], prot[b], cfg, True)
        moved = _emit(trace[b].tolist(), ref["ops"], -1, K, -1)
        written = [f or r for f, r in zip(ref["filled"], ref["rewritten"])]
        assert got[b].tolist() == [100 + b if w else m for w, m in zip(written, moved)]
        pos = torch.arange(20, 20 + K)
        log = lev_log(st, b, pos, T(cur[b]), 17, DEL_ID, INS_ID)
        want = []
        for i, op in enumerate(ref["ops"]):
            if op == DEL:
                want.append((i + 3, cur[b][i], DEL_ID))
            elif op == INS:
                want.append((i + 3, cur[b][i], INS_ID))
            elif op == SUB and ref["base_t2t"][i]:
                want.append((i + 3, cur[b][i], ref["tokens"][i]))
        assert log == want


def test_edit_probs_are_the_softmax_of_the_edit_tokens():
    x = torch.randn(2, 3, 95, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    got = edit_probs(x.to(torch.bfloat16), DEL_ID, INS_ID)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 2)
    ref = x.to(torch.bfloat16).double().softmax(-1)[..., [DEL_ID, INS_ID]]
    # fp32 softmax over 95 terms of bf16-exact logits: a few fp32 ulps relative
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
