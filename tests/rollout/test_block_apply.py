"""`rollout.block_apply` writes each row's decisions into the engine's slots and the sequences' counters: checked
against the pure step functions applied one row at a time and a plain loop of the Multi-Block Editing rule. Random
slots, blocks, prompt boundaries inside the block, block counters near the forward cap; with and without DELETE /
INSERT."""
import random

import pytest
import torch

from rollout import DecodeConfig
from rollout.block_apply import SlotTensors, apply_block_steps, apply_mbe_pass
from rollout.levenshtein import DEL, INS, lev_log, levenshtein_block_step, shift_trace
from rollout.sequence import Sequence
from rollout.steps import block_done, block_step

MASK, K, B, NB = 1, 4, 5, 4
LEV = (90, 91)


def _state(rng, g, mask_rate=0.5):
    T = K * NB
    canvas = torch.randint(3, 8, (B, T), generator=g)
    canvas[torch.rand(B, T, generator=g) < mask_rate] = MASK
    return SlotTensors(canvas=canvas, trace=torch.randint(-1, 5, (B, T), generator=g),
                       post_steps=torch.randint(0, 3, (B,), generator=g),
                       block_iters=torch.randint(0, 2 * K, (B,), generator=g))


def _seqs(rng, n):
    out = []
    for i, slot in enumerate(rng.sample(range(B), n)):
        block = rng.randrange(1, NB)
        prompt_len = rng.randint(0, block * K + K - 1)
        s = Sequence(id=10 + i, prompt=[5] * prompt_len, slot=slot, block=block, forwards=rng.randint(0, 6),
                     start=max(prompt_len, rng.randint(block * K - 2, block * K + K - 1)))
        s.turn_forwards = rng.randint(0, 3)
        s.edits, s.edit_log = rng.randint(0, 4), [("earlier",)]
        s.deletes, s.inserts = rng.randint(0, 3), rng.randint(0, 3)  # counts of earlier rounds: added to
        out.append(s)
    return out


def _candidates(g, n, grid=(0.1, 0.5, 0.7, 0.95)):
    tok = torch.randint(3, 8, (n, K), generator=g)
    prob = torch.tensor(grid)[torch.randint(0, len(grid), (n, K), generator=g)]
    eprob = torch.tensor([0.05, 0.3, 0.6])[torch.randint(0, 3, (n, K, 2), generator=g)]
    return [(tok[j], prob[j], eprob[j]) for j in range(n)]


def _cfg(lev, seed):
    kw = dict(tau_delete=0.25, tau_insert=0.25, max_lev_edits=2) if lev else {}
    return DecodeConfig.preset("quality", tau_edit=[0.6, None, 0.0][seed % 3] if not lev else 0.6,
                               early_commit=[None, 0.6][seed % 2], max_post_steps=seed % 3, **kw)


@pytest.mark.parametrize("lev", [False, True])
@pytest.mark.parametrize("seed", range(16))
def test_apply_block_steps_matches_the_step_functions_row_by_row(lev, seed):
    """Seeds 8-15: few masks and confident candidates, so that blocks fill up in this step (the block-end rule's
    editing and early-commit branches then decide)."""
    _check_block_steps(lev, seed, _cfg(lev, seed), filling=seed >= 8)


@pytest.mark.parametrize("lev", [False, True])
@pytest.mark.parametrize("early_commit", [0.6, 0.9, 0.97])
@pytest.mark.parametrize("seed", range(6))
def test_early_commit_ends_a_block_that_fills_up_surely(lev, early_commit, seed):
    """Editing on but no candidate confident enough to edit (tau_edit 0.99), post-steps wanted: a block that fills
    up in this step ends only through early commit, when every token it filled has prob > early_commit."""
    kw = dict(tau_delete=0.99, tau_insert=0.99) if lev else {}
    cfg = DecodeConfig.preset("quality", tau_edit=0.99, early_commit=early_commit, max_post_steps=2, **kw)
    _check_block_steps(lev, 100 + seed, cfg, filling=True)


def _check_block_steps(lev, seed, cfg, filling):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    st = _state(rng, g, 0.2 if filling else 0.5)
    seqs = _seqs(rng, rng.randint(1, B))
    results = _candidates(g, len(seqs), (0.5, 0.95, 0.95, 0.95) if filling else (0.1, 0.5, 0.7, 0.95))
    before = SlotTensors(*(t.clone() for t in (st.canvas, st.trace, st.post_steps, st.block_iters)))
    old = [(s.forwards, s.turn_forwards, s.edits, list(s.edit_log)) for s in seqs]
    old_ops = [(s.deletes, s.inserts) for s in seqs]
    events = []
    done, wrote = apply_block_steps(st, seqs, results, cfg, K, MASK, LEV if lev else None, events)
    cap = K + cfg.max_post_steps + 1
    canvas, trace = before.canvas.clone(), before.trace.clone()
    post_steps, iters_all = before.post_steps.clone(), before.block_iters.clone()
    for j, s in enumerate(seqs):
        r, pos = s.slot, torch.arange(s.block * K, s.block * K + K)
        cur, prot = before.canvas[r, pos][None], (pos < s.start)[None]
        tok, prob, eprob = (x[None] for x in results[j])
        iters = before.block_iters[r:r + 1] + 1
        if lev:
            ls = levenshtein_block_step(tok, prob, eprob, cur, prot, MASK, cfg, ops_allowed=iters < cap)
            res = ls.result
        else:
            res = block_step(tok, prob, cur, prot, MASK, cfg.tau_mask, cfg.tau_edit, cfg.num_to_transfer)
        d, p = block_done(res, before.post_steps[r:r + 1], iters, cfg.max_post_steps, cap,
                          cfg.editing or cfg.levenshtein, prob, cfg.early_commit)
        if lev:
            d = d & (res.masks_left == 0)
        canvas[r, pos] = res.new[0]
        f0, tf0, e0, log0 = old[j]
        trace[r, pos] = (shift_trace(before.trace[r, pos][None], ls, torch.tensor([[f0]]))[0] if lev else
                         torch.where(res.m2t[0] | res.t2t[0], f0, before.trace[r, pos]))
        post_steps[r], iters_all[r] = p[0], iters[0]
        assert done[j] == bool(d[0]) and wrote[j] == bool((res.m2t | res.t2t).any())
        n_edit = int(res.t2t.sum())
        assert (s.forwards, s.turn_forwards, s.edits) == (f0 + 1, tf0 + 1, e0 + n_edit)
        ev = events[j]
        assert (ev.seq, ev.forward, ev.kind, ev.block, ev.prompt_len, ev.block_done) == (
            s.id, f0, "block", s.block, s.prompt_len, done[j])
        if lev:
            ops = ls.ops[0]
            log = lev_log(ls, 0, pos, cur[0], s.prompt_len, *LEV) if n_edit else []
            d0, i0 = old_ops[j]
            assert (s.deletes, s.inserts) == ((d0 + int((ops == DEL).sum()), i0 + int((ops == INS).sum())) if n_edit
                                              else (d0, i0))
            assert s.lev_drafts == ({s.block: cur[0].tolist()} if ((ops == DEL) | (ops == INS)).any() else {})
            assert (ev.filled, ev.edited) == (pos[ls.filled[0]].tolist(), pos[ls.rewritten[0]].tolist())
            assert (ev.deleted, ev.inserted) == (pos[ops == DEL].tolist(), pos[ops == INS].tolist())
        else:
            e = res.t2t[0]
            log = list(zip((pos[e] - s.prompt_len).tolist(), cur[0][e].tolist(), res.new[0][e].tolist()))
            assert (ev.filled, ev.edited) == (pos[res.m2t[0]].tolist(), pos[res.t2t[0]].tolist())
            assert (ev.deleted, ev.inserted) == ([], [])
        assert s.edit_log == log0 + log
    assert torch.equal(st.canvas, canvas) and torch.equal(st.trace, trace)
    assert torch.equal(st.post_steps, post_steps) and torch.equal(st.block_iters, iters_all)


def test_apply_block_steps_without_events_still_updates_the_sequences():
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    st = _state(rng, g)
    seqs = _seqs(rng, 2)
    f = [s.forwards for s in seqs]
    apply_block_steps(st, seqs, _candidates(g, 2), _cfg(False, 0), K, MASK, None, None)
    assert [s.forwards for s in seqs] == [x + 1 for x in f]


@pytest.mark.parametrize("seed", range(24))
def test_apply_mbe_pass_matches_a_plain_loop(seed):
    """Window positions of the current turn (>= start) whose candidate differs with prob > mbe_tau are rewritten;
    the pass is the last when nothing changed or mbe_max_passes passes ran."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(100 + seed)
    st = _state(rng, g)
    s = _seqs(rng, 1)[0]
    s.mbe_passes = rng.randint(0, 2)
    s.mbe_first_changed = rng.choice([None, 0, 3])
    s.mbe_edits = rng.randint(0, 3)
    cfg = DecodeConfig.preset("quality", mbe_window=2, mbe_tau=rng.choice([0.5, 0.7]), mbe_max_passes=rng.choice([1, 3]))
    t_start = rng.randrange(0, K * NB - K)
    t_len = rng.randint(1, K * NB - t_start)
    s.start = rng.randint(t_start, t_start + t_len - 1)  # the turn starts inside the window: both sides occur
    window = st.canvas[s.slot, t_start:t_start + t_len]
    # about a third of the candidates repeat the window's token (never a change, whatever their probability)
    tok = torch.where(torch.rand(t_len, generator=g) < 0.35, window, torch.randint(3, 8, (t_len,), generator=g))
    prob = torch.tensor([0.1, 0.5, 0.7, 0.95])[torch.randint(0, 4, (t_len,), generator=g)]
    canvas, trace = st.canvas.clone(), st.trace.clone()
    old = (s.forwards, s.turn_forwards, s.edits, s.mbe_edits, s.mbe_passes, s.mbe_first_changed, list(s.edit_log))
    events = []
    last = apply_mbe_pass(st, s, (tok, prob, None), t_start, t_len, cfg, K, events)
    r, changed, log = s.slot, [], []
    for i in range(t_len):
        p = t_start + i
        if p >= s.start and int(tok[i]) != int(canvas[r, p]) and float(prob[i]) > cfg.mbe_tau:
            changed.append(p)
            log.append((p - s.prompt_len, int(canvas[r, p]), int(tok[i])))
            canvas[r, p], trace[r, p] = tok[i], old[0]
    assert torch.equal(st.canvas, canvas) and torch.equal(st.trace, trace)
    n = len(changed)
    first = old[5] if not changed else min(changed[0] // K, old[5]) if old[5] is not None else changed[0] // K
    assert (s.forwards, s.turn_forwards, s.edits, s.mbe_edits, s.mbe_passes, s.mbe_first_changed) == (
        old[0] + 1, old[1] + 1, old[2] + n, old[3] + n, old[4] + 1, first)
    assert s.edit_log == old[6] + log
    assert last == (n == 0 or old[4] + 1 >= cfg.mbe_max_passes)
    ev = events[0]
    assert (ev.seq, ev.forward, ev.kind, ev.block, ev.prompt_len, ev.edited, ev.filled, ev.block_done) == (
        s.id, old[0], "mbe", s.block, s.prompt_len, changed, [], True)
