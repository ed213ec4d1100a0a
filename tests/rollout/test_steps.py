"""Pure step functions against brute-force per-row loops over random inputs.

The Multi-Block Editing threshold, `first_eos`, `block_done` and the tied fallback of `block_step` against plain
rules, on classes of inputs."""
import random

import pytest
import torch

from rollout.steps import StepResult, block_done, block_step, first_eos, m2t_set, mbe_edit_set, penalty_targets, t2t_set


MASK = 2


def _random_block(B=64, K=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cur = torch.randint(3, 9, (B, K), generator=g)
    cur[torch.rand(B, K, generator=g) < 0.5] = MASK
    tok = torch.randint(3, 9, (B, K), generator=g)
    prob = torch.rand(B, K, generator=g)
    protected = torch.arange(K)[None] < torch.randint(0, 4, (B, 1), generator=g)
    return tok, prob, cur, protected


@pytest.mark.parametrize("ntt", [1, 2, 3])
def test_m2t_set_matches_brute_force(ntt):
    tok, prob, cur, protected = _random_block(seed=ntt)
    is_mask = (cur == MASK) & ~protected
    got = m2t_set(prob, is_mask, 0.6, ntt)
    for b in range(cur.shape[0]):
        masks = [k for k in range(cur.shape[1]) if is_mask[b, k]]
        passing = [k for k in masks if prob[b, k] > 0.6]
        if len(passing) < ntt:
            passing = sorted(masks, key=lambda k: -float(prob[b, k]))[:ntt]
        assert sorted(torch.nonzero(got[b]).flatten().tolist()) == sorted(passing)


def test_t2t_set_and_block_step_match_brute_force():
    tok, prob, cur, protected = _random_block(seed=7)
    res = block_step(tok, prob, cur, protected, MASK, tau_mask=0.7, tau_edit=0.4, num_to_transfer=1)
    for b in range(cur.shape[0]):
        for k in range(cur.shape[1]):
            visible = cur[b, k] != MASK and not protected[b, k]
            edit = bool(visible and tok[b, k] != cur[b, k] and prob[b, k] > 0.4)
            assert bool(res.t2t[b, k]) == edit
            expect = tok[b, k] if (res.m2t[b, k] or edit) else cur[b, k]
            assert res.new[b, k] == expect
            if protected[b, k]:
                assert res.new[b, k] == cur[b, k]
    off = t2t_set(tok, prob, cur, cur == MASK, protected, None)
    assert not off.any() and not t2t_set(tok, prob, cur, cur == MASK, protected, -1.0).any()


def test_strict_thresholds():
    prob = torch.tensor([[0.5, 0.5]])
    is_mask = torch.tensor([[True, True]])
    assert m2t_set(prob, is_mask, 0.5, 0).sum() == 0  # p == tau does not pass
    tok, cur = torch.tensor([[5, 6]]), torch.tensor([[4, 4]])
    assert t2t_set(tok, prob, cur, ~is_mask, torch.zeros_like(is_mask), 0.5).sum() == 0


def _res(had_masks, edited, masks_left):
    t2t = torch.zeros(len(had_masks), 4, dtype=torch.bool)
    t2t[:, 0] = torch.tensor(edited)
    return StepResult(new=None, m2t=None, t2t=t2t, had_masks=torch.tensor(had_masks),
                      masks_left=torch.tensor(masks_left))


def test_block_done_rule():
    # rows: (1) filling, masks left; (2) post-step with an edit; (3) post-step without edit;
    # (4) just filled the last mask (not a post-step yet); (5) post-step with edit reaching max_post_steps
    res = _res([True, False, False, True, False], [False, True, False, True, True], [2, 0, 0, 0, 0])
    post = torch.tensor([0, 0, 1, 0, 2])
    iters = torch.tensor([1, 5, 6, 4, 9])
    done, new_post = block_done(res, post, iters, max_post_steps=3, block_cap=20, editing=True)
    assert done.tolist() == [False, False, True, False, True]
    assert new_post.tolist() == [0, 1, 2, 0, 3]
    # editing off: the block ends the moment it is full; max_post_steps 0 likewise
    done_off, _ = block_done(res, post, iters, max_post_steps=3, block_cap=20, editing=False)
    assert done_off.tolist() == [False, True, True, True, True]
    done0, _ = block_done(res, post, iters, max_post_steps=0, block_cap=20, editing=True)
    assert done0.tolist() == [False, True, True, True, True]
    # the forward cap ends any block
    cap, _ = block_done(res, post, torch.full((5,), 20), max_post_steps=3, block_cap=20, editing=True)
    assert cap.all()


def test_penalty_targets():
    prev = torch.tensor([[5, MASK, 7]])
    assert penalty_targets(prev, MASK).tolist() == [[5, -1, 7]]


def test_early_commit_ends_a_block_only_after_a_confident_last_fill_without_edits():
    # rows: (1) last masks filled at 0.95/0.97, no edit; (2) the same but one fill at 0.80;
    # (3) last masks filled confidently but an edit in the same step; (4) masks left after a confident fill;
    # (5) a post-step (no masks at the start) that edited
    m2t = torch.tensor([[True, True, False], [True, True, False], [True, False, False], [True, False, False],
                        [False, False, False]])
    t2t = torch.tensor([[False] * 3, [False] * 3, [False, True, False], [False] * 3, [False, True, False]])
    res = StepResult(new=None, m2t=m2t, t2t=t2t, had_masks=torch.tensor([True, True, True, True, False]),
                     masks_left=torch.tensor([0, 0, 0, 1, 0]))
    prob = torch.tensor([[0.95, 0.97, 0.1], [0.95, 0.80, 0.99], [0.99, 0.2, 0.2], [0.99, 0.2, 0.2], [0.99] * 3])
    post, iters = torch.zeros(5, dtype=torch.long), torch.full((5,), 3)
    off, _ = block_done(res, post, iters, max_post_steps=3, block_cap=20, editing=True, prob=prob)
    assert not off.any(), "early_commit None is the reference rule: a filled block still gets its post-step"
    done, _ = block_done(res, post, iters, max_post_steps=3, block_cap=20, editing=True, prob=prob, early_commit=0.9)
    assert done.tolist() == [True, False, False, False, False]
    low, _ = block_done(res, post, iters, max_post_steps=3, block_cap=20, editing=True, prob=prob, early_commit=0.5)
    assert low.tolist() == [True, True, False, False, False]


def test_early_commit_decodes_with_fewer_forwards_in_both_steps(monkeypatch):
    import rollout.compiled as compiled

    from ebpo.model import LLaDA2MoeModelLM, tiny_config
    from rollout import DecodeConfig, generate

    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # confident candidates
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    base = generate(model, prompts, DecodeConfig.preset("speed", max_new_tokens=32, stop_at_eos=False))
    fast = generate(model, prompts, DecodeConfig.preset("speed", max_new_tokens=32, stop_at_eos=False,
                                                        early_commit=0.0))
    assert sum(o.num_forwards for o in fast) < sum(o.num_forwards for o in base)
    monkeypatch.setattr(compiled, "COMPILE", False)
    fixed = generate(model, prompts, DecodeConfig.preset("speed", max_new_tokens=32, stop_at_eos=False,
                                                         early_commit=0.0, compiled_step=True))
    assert [o.token_ids for o in fixed] == [o.token_ids for o in fast]
    assert [o.num_forwards for o in fixed] == [o.num_forwards for o in fast]
    with pytest.raises(ValueError, match="early_commit"):
        DecodeConfig.preset("speed", early_commit=1.5)


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
