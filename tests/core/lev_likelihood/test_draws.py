"""The L-EBPO draws and their statistics (ebpo.core.lev_likelihood), each against a plain reading of its docstring.

* `levenshtein_draws` refuses draws that carry T2T substitutions and weighs edits 1 by default; `learner_draws`
  guards its inputs; `drafts_from_rollouts` skips only the records out of range;
* `learner_draws` pads a partial last block with [MASK] for the alignment and cuts it back: for every block size
  and every remainder L mod K, each block's labels are those of a plain per-block reading of the rules with the
  partial block padded by [MASK] (tests/support/lev_reference.py);
* `lev_stats` are means per (draw, sequence);
* both draws make their tensors on the inputs' device (tests/support/devices.py)."""
import random
import types
from types import SimpleNamespace

import pytest
import torch

from ebpo.core.lev_likelihood import drafts_from_rollouts, learner_draws, lev_stats, levenshtein_draws
from ebpo.core.likelihood import NoiseDraws, draw_noise
from tests.support import lev_reference as ref
from tests.support.devices import assert_same, under_default

MASK, DEL, INS = 2, 105, 106


def _case(K, L, seed):
    rng = random.Random(seed)
    B = 3
    ids = torch.tensor([[rng.randint(5, 9) for _ in range(L)] for _ in range(B)])  # few tokens: many repeats
    resp = torch.zeros(B, L, dtype=torch.bool)
    prompt_lens = [rng.randint(0, L - 1) for _ in range(B)]
    for i, p in enumerate(prompt_lens):
        resp[i, p:] = True
    lev = []  # pre-edit drafts of some blocks (one past L is ignored: the partial last block's)
    for i, p in enumerate(prompt_lens):
        recs = []
        for b0 in range(0, L, K):
            if rng.random() < 0.6 and b0 + K > p:  # a block holding response tokens; its context stays as is
                recs.append((b0 - p, [int(ids[i, q]) if q < min(p, L) else rng.choice([MASK, 5, 6, 7, 8, 9])
                                      for q in range(b0, b0 + K)]))
        lev.append(recs)
    return ids, resp, prompt_lens, lev


def _plain_draws(noise, ids, resp, prompt_lens, lev, K):
    """Targets and scored-visible flags of every (draw, row, position), block by block in plain Python, the
    partial last block padded with [MASK] (draft and output alike) and cut back."""
    N, B, L = noise.masked.shape
    targets = torch.zeros(N, B, L, dtype=torch.long)
    edited = torch.zeros(N, B, L, dtype=torch.bool)
    for i in range(B):
        draft = ids[i].tolist()
        for start, toks in lev[i]:
            lo = prompt_lens[i] + start
            if 0 <= lo and lo + K <= L:
                draft[lo:lo + K] = toks
        for n in range(N):
            for b0 in range(0, L, K):
                hi = min(b0 + K, L)
                z = [MASK if noise.masked[n, i, p] else draft[p] for p in range(b0, hi)] + [MASK] * (b0 + K - hi)
                y = ids[i, b0:hi].tolist() + [MASK] * (b0 + K - hi)
                lab = ref.label_ids(z, y, MASK, DEL, INS)
                for p in range(b0, hi):
                    targets[n, i, p] = lab[p - b0]
                    edited[n, i, p] = bool(resp[i, p]) and not bool(noise.masked[n, i, p]) and lab[p - b0] != z[p - b0]
    return targets, edited


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_learner_draws_pad_every_remainder_as_a_plain_per_block_loop(K):
    cfg = types.SimpleNamespace(delete_token_id=DEL, insert_token_id=INS, mask_token_id=MASK)
    for r, seed in [(r, s) for r in range(K) for s in range(4)]:  # every remainder, 0 (whole blocks) included
        L = 2 * K + r
        ids, resp, prompt_lens, lev = _case(K, L, seed=100 * K + 10 * r + seed)
        noise = draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(r))
        out = learner_draws(noise, ids, resp, prompt_lens, lev, cfg, weight=0.7)
        targets, edited = _plain_draws(noise, ids, resp, prompt_lens, lev, K)
        assert out.targets.shape == (3, 3, L) and torch.equal(out.masked, noise.masked)
        assert torch.equal(out.targets, targets), (K, r)
        assert torch.equal(out.substituted, edited), (K, r)
        assert torch.equal(out.weight, torch.where(edited, torch.full_like(noise.weight, 0.7), noise.weight))
        assert out.noisy_ids.shape == (3, 3, L)


K = 4


def _batch(B=3, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate([3, 6, 1][:B]):
        resp[b, p:] = True
    return ids, resp, draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(seed + 1))


def test_levenshtein_and_learner_draws_follow_the_inputs_device():
    ids, resp, noise = _batch()
    drafts = ids.clone()
    drafts[:, 8:10] = ids[:, 9:11]  # a shifted stretch: DELETE / INSERT labels
    cfg = types.SimpleNamespace(mask_token_id=MASK, delete_token_id=DEL, insert_token_id=INS)
    noise14 = draw_noise(resp[:, :14], K, 3, 0.2, 0.9, torch.Generator().manual_seed(9))  # a partial last block
    outs = {}
    for dev in (None, "meta"):
        with under_default(dev):
            outs[dev] = (levenshtein_draws(noise, ids, resp, drafts, MASK, DEL, INS, weight=0.5),
                         learner_draws(noise14, ids[:, :14], resp[:, :14], [3, 6, 1],
                                       [[(5, ids[0, 8:12].tolist())], [], []], cfg, 1.0))
    for w, g in zip(outs[None], outs["meta"]):
        assert_same(w, g)
    assert ((outs[None][0].targets == DEL) | (outs[None][0].targets == INS)).any()


MASK_ID, DEL_ID, INS_ID = 0, 90, 91


def _noise(B=2, L=8, K=4, seed=0):
    resp = torch.zeros(B, L, dtype=torch.bool)
    resp[:, 2:] = True
    return resp, draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(seed))


def test_levenshtein_draws_refuse_any_t2t_draws_and_default_to_weight_one():
    resp, noise = _noise()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [6, 6, 7, 7, 8, 8, 9, 9]])
    for extra in ({"substituted": noise.masked.clone()}, {"noisy_ids": torch.zeros_like(noise.masked, dtype=torch.long)},
                  {"substituted": noise.masked.clone(), "noisy_ids": torch.zeros_like(noise.masked, dtype=torch.long)}):
        bad = NoiseDraws(noise.masked, noise.t, noise.weight, 4, **extra)
        with pytest.raises(ValueError, match=r"^learner\.levenshtein: combine it with mask-only draws "
                                             r"\(learner\.t2t_weight = 0\)$"):
            levenshtein_draws(bad, ids, resp, None, MASK_ID, DEL_ID, INS_ID)
    with pytest.raises(ValueError, match=r"^levenshtein_draws: length 7 is not a multiple of the block size 4$"):
        n7 = NoiseDraws(noise.masked[..., :7], noise.t, noise.weight[..., :7], 4)
        levenshtein_draws(n7, ids[:, :7], resp[:, :7], None, MASK_ID, DEL_ID, INS_ID)
    drafts = ids.clone()
    drafts[:, 4:8] = torch.tensor([9, 9, 8, 7])  # an edited block: visible non-keep labels
    out = levenshtein_draws(noise, ids, resp, drafts, MASK_ID, DEL_ID, INS_ID)
    assert out.substituted.any() and (out.weight[out.substituted] == 1.0).all()
    assert out.t is noise.t and torch.equal(out.masked, noise.masked)


def test_learner_draws_guards():
    resp, noise = _noise()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [6, 6, 7, 7, 8, 8, 9, 9]])
    for cfg in (types.SimpleNamespace(mask_token_id=MASK_ID),
                types.SimpleNamespace(mask_token_id=MASK_ID, delete_token_id=None)):
        with pytest.raises(ValueError, match=r"^learner\.levenshtein: the model's config has no delete_token_id / "
                                             r"insert_token_id$"):
            learner_draws(noise, ids, resp, [2, 2], None, cfg, 1.0)
    cfg = types.SimpleNamespace(mask_token_id=MASK_ID, delete_token_id=DEL_ID, insert_token_id=INS_ID)
    # a draft that rewrites the context opening its block (prompt positions 0, 1 of the first block) is refused
    with pytest.raises(ValueError, match=r"^lev_drafts: row 0, block at offset -2: the draft changes the 2 context "):
        learner_draws(noise, ids, resp, [2, 2], [[(-2, [1, 6, 9, 9])], []], cfg, 1.0)
    learner_draws(noise, ids, resp, [2, 2], [[(-2, [5, 6, 9, 9])], []], cfg, 1.0)  # context kept: fine


def test_drafts_from_rollouts_skips_only_the_records_out_of_range():
    ids = torch.arange(10, 22).view(1, 12)
    resp = torch.ones(1, 12, dtype=torch.bool)
    recs = [[(20, [1, 1, 1, 1]), (-5, [2, 2, 2, 2]), (4, [3, 3, 3, 3]), (10, [4, 4, 4, 4])]]
    out = drafts_from_rollouts(ids, torch.tensor([0]), recs, 4, resp)
    assert out.tolist() == [[10, 11, 12, 13, 3, 3, 3, 3, 18, 19, 20, 21]]
    assert out.dtype == ids.dtype
    # the check covers exactly the block: context after the block's start is checked, the next block is not
    resp2 = torch.tensor([[False] * 6 + [True] * 6])
    with pytest.raises(ValueError, match=r"^lev_drafts: row 0, block at offset 4: the draft changes the 2 context"):
        drafts_from_rollouts(ids, torch.tensor([0]), [[(4, [3, 3, 3, 3])]], 4, resp2)
    ok = drafts_from_rollouts(ids, torch.tensor([0]), [[(4, [14, 15, 3, 3])]], 4, resp2)
    assert ok[0, 4:8].tolist() == [14, 15, 3, 3]


def test_lev_stats_are_means_per_draw_and_sequence():
    """DELETE labels, INSERT labels (among scored positions) and substituted (visible scored) positions, each
    summed over draws, sequences and positions and divided by draws x sequences."""
    N, B, L, DEL, INS = 3, 5, 8, 90, 91
    g = torch.Generator().manual_seed(4)
    masked = torch.rand(N, B, L, generator=g) < 0.4
    substituted = (torch.rand(N, B, L, generator=g) < 0.3) & ~masked
    targets = torch.randint(88, 92, (N, B, L), generator=g)  # DEL / INS also at unscored positions
    noise = NoiseDraws(masked, torch.ones(N, B, 2), torch.zeros(N, B, L), 4, substituted=substituted,
                       targets=targets)
    got = lev_stats(noise, SimpleNamespace(delete_token_id=DEL, insert_token_id=INS))
    dels = ins = vis = 0
    for n in range(N):
        for b in range(B):
            for i in range(L):
                scored = bool(masked[n, b, i] or substituted[n, b, i])
                dels += scored and int(targets[n, b, i]) == DEL
                ins += scored and int(targets[n, b, i]) == INS
                vis += bool(substituted[n, b, i])
    assert got == {"likelihood/lev_deletes_per_seq": pytest.approx(dels / (N * B)),
                   "likelihood/lev_inserts_per_seq": pytest.approx(ins / (N * B)),
                   "likelihood/lev_visible_scored_per_seq": pytest.approx(vis / (N * B))}
    assert dels and ins and vis
    assert lev_stats(NoiseDraws(masked, torch.ones(N, B, 2), torch.zeros(N, B, L), 4), None) == {}
