"""Edit precision counts, the Multi-Block Editing threshold and `first_eos` against plain rules, on classes of
inputs (issue 40's mutation run of rollout/edits.py and rollout/steps.py)."""
import random

import pytest
import torch

from rollout.edits import EditCounts, edit_counts, edit_metrics
from rollout.steps import StepResult, block_done, block_step, first_eos, mbe_edit_set


@pytest.mark.parametrize("seed", range(6))
def test_edit_counts_match_the_documented_rule_for_every_offset(seed):
    """Every offset from before the reference to past its end (the end itself included), tokens drawn from a
    tiny alphabet so that fixes, breaks and neutral edits (wrong -> other wrong) all occur."""
    rng = random.Random(seed)
    ref = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
    log = [(rng.randint(-2, len(ref) + 2), rng.randrange(3), rng.randrange(3)) for _ in range(40)]
    log += [(len(ref), ref[-1], ref[-1] + 1)]  # exactly one past the end: an edit, never a fix or a break
    fixes = breaks = 0
    for off, old, new in log:
        if 0 <= off < len(ref):
            fixes += old != ref[off] and new == ref[off]
            breaks += old == ref[off] and new != ref[off]
    assert edit_counts(log, ref) == EditCounts(len(log), fixes, breaks)


def test_neutral_edits_are_neither_fixes_nor_breaks():
    ref = [5, 6, 7]
    assert edit_counts([(0, 1, 2), (1, 3, 4), (2, 8, 9)], ref) == EditCounts(3, 0, 0)


def test_edit_metrics_default_prefix_is_eval():
    m = edit_metrics(["math"], [EditCounts(2, 1, 1)])
    assert m == {"eval/math/edit_precision": 0.5, "eval/math/edits_per_seq": 2.0, "eval/math/fixes_per_seq": 1.0,
                 "eval/math/breaks_per_seq": 1.0}


@pytest.mark.parametrize("tau", [0.25, 0.5, 0.75])
def test_mbe_edit_set_is_strictly_above_tau(tau):
    """Editable positions whose candidate differs, with prob > tau (a probability equal to tau does not pass)."""
    g = torch.Generator().manual_seed(int(tau * 100))
    B, T = 4, 16
    cur = torch.randint(0, 3, (B, T), generator=g)
    tok = torch.randint(0, 3, (B, T), generator=g)
    prob = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])[torch.randint(0, 5, (B, T), generator=g)]
    editable = torch.rand(B, T, generator=g) < 0.7
    got = mbe_edit_set(tok, prob, cur, editable, tau)
    for b in range(B):
        for t in range(T):
            assert bool(got[b, t]) == bool(editable[b, t] and tok[b, t] != cur[b, t] and prob[b, t] > tau)


@pytest.mark.parametrize("seed", range(5))
def test_first_eos_is_the_index_of_the_first_eos(seed):
    rng = random.Random(seed)
    eos = {1, 2}
    toks = [rng.randrange(6) for _ in range(rng.randint(0, 12))]
    expect = next((i for i, t in enumerate(toks) if t in eos), None)
    assert first_eos(toks, eos) == expect
    assert first_eos([7, 8, 9], eos) is None and first_eos([3, 2, 1], eos) == 1


@pytest.mark.parametrize("early_commit", [None, 0.5, 0.75])
@pytest.mark.parametrize("editing", [True, False])
def test_block_done_matches_a_plain_loop(early_commit, editing):
    """The block-end rule of `block_done`, one row at a time; probabilities on a grid that holds the early-commit
    threshold itself (a filled token with prob == early_commit is not sure: the threshold is strict)."""
    g = torch.Generator().manual_seed(3 if editing else 4)
    B, K, max_post, cap = 256, 4, 1, 6
    had = torch.rand(B, generator=g) < 0.6
    left = torch.randint(0, 2, (B,), generator=g) * torch.randint(0, 3, (B,), generator=g)
    t2t = torch.rand(B, K, generator=g) < 0.15
    m2t = (torch.rand(B, K, generator=g) < 0.5) & had[:, None]
    prob = torch.tensor([0.25, 0.5, 0.75, 1.0])[torch.randint(0, 4, (B, K), generator=g)]
    post0 = torch.randint(0, 3, (B,), generator=g)
    iters = torch.randint(1, 8, (B,), generator=g)
    res = StepResult(new=None, m2t=m2t, t2t=t2t, had_masks=had, masks_left=left)
    done, post = block_done(res, post0, iters, max_post, cap, editing, prob, early_commit)
    for b in range(B):
        p = int(post0[b]) + (not had[b])
        full, edited = int(left[b]) == 0, bool(t2t[b].any())
        d = (not had[b] and not edited) or (full and p >= max_post) or int(iters[b]) >= cap or (not editing and full)
        if early_commit is not None:
            filled = [float(prob[b, k]) for k in range(K) if m2t[b, k]]
            d = d or (bool(had[b]) and full and not edited and all(q > early_commit for q in filled))
        assert int(post[b]) == p and bool(done[b]) == d


@pytest.mark.parametrize("K", [8, 32])
@pytest.mark.parametrize("ntt", [1, 2])
def test_block_step_counts_and_tied_fallback_match_a_plain_loop(K, ntt):
    """Per row: the masks at the start (prompt positions excluded, even where the prompt holds the mask id), the
    masks left after the write, and the M2T fallback among tied confidences taking the earliest positions
    (K = 32, the released block size, is where an unstable sort reorders ties)."""
    MASK = 2
    g = torch.Generator().manual_seed(K + ntt)
    B = 64
    cur = torch.randint(3, 6, (B, K), generator=g)
    cur[torch.rand(B, K, generator=g) < 0.6] = MASK
    cur[::7] = 4  # rows without a mask
    tok = torch.randint(3, 6, (B, K), generator=g)
    prob = torch.tensor([0.2, 0.4])[torch.randint(0, 2, (B, K), generator=g)]  # all below tau_mask: the fallback
    protected = torch.arange(K)[None] < torch.randint(0, 5, (B, 1), generator=g)
    res = block_step(tok, prob, cur, protected, MASK, tau_mask=0.9, tau_edit=None, num_to_transfer=ntt)
    for b in range(B):
        masks = [k for k in range(K) if cur[b, k] == MASK and not protected[b, k]]
        chosen = sorted(masks, key=lambda k: -float(prob[b, k]))[:ntt]  # Python's sort is stable: ties by index
        new = [int(tok[b, k]) if k in chosen else int(cur[b, k]) for k in range(K)]
        assert res.m2t[b].nonzero().flatten().tolist() == sorted(chosen)
        assert res.new[b].tolist() == new
        assert bool(res.had_masks[b]) == bool(masks)
        assert int(res.masks_left[b]) == sum(1 for k in range(K) if new[k] == MASK and not protected[b, k])
    assert res.had_masks.shape == (B,) and res.masks_left.shape == (B,)
