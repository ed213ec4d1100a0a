"""Rules of small ebpo/core helpers that the mutation run of issue 40 found unpinned: documented dataclass
fields, TurnLayout tensors, label rounds to a target, ops_from_ids' tokens, and the L-EBPO draws' guards."""
import dataclasses
import random
import types

import pytest
import torch

from ebpo.core.fields import doc
from ebpo.core.lev_likelihood import drafts_from_rollouts, learner_draws, levenshtein_draws
from ebpo.core.levenshtein import DEL, INS, KEEP, SUB, apply_ops, label_ids, lcs_labels, ops_from_ids, rounds_to_target
from ebpo.core.likelihood import NoiseDraws, draw_noise
from ebpo.core.turns import TurnLayout

MASK, DEL_ID, INS_ID = 0, 90, 91


def test_doc_fields_carry_help_default_and_factory():
    @dataclasses.dataclass
    class C:
        a: int = doc("the a", 3)
        b: list = doc("the b", default_factory=lambda: [1])
        c: int = doc("the c", None)

    f = {x.name: x for x in dataclasses.fields(C)}
    assert f["a"].metadata["help"] == "the a" and f["a"].default == 3
    assert f["b"].metadata["help"] == "the b" and f["b"].default is dataclasses.MISSING and C().b == [1]
    assert f["c"].default is None and f["c"].default_factory is dataclasses.MISSING
    assert C() == C(3, [1], None) and C().b is not C().b
    required = doc("required")
    assert required.default is dataclasses.MISSING and required.default_factory is dataclasses.MISSING
    assert dict(required.metadata) == {"help": "required"}


@pytest.mark.parametrize("n", [0, 1, 5])
def test_turn_layout_tensors_have_the_documented_dtypes_even_empty(n):
    ids, gen, seg = TurnLayout(list(range(n)), [True] * n, [1] * n).tensors()
    assert (ids.dtype, gen.dtype, seg.dtype) == (torch.long, torch.bool, torch.long)
    assert ids.tolist() == list(range(n)) and gen.tolist() == [True] * n and seg.tolist() == [1] * n


def _plain_rounds(x, y, max_rounds):
    cur = torch.tensor([x])
    for r in range(max_rounds + 1):
        if cur[0].tolist() == y:
            return r
        ops, toks = lcs_labels(cur, torch.tensor([y]), MASK)
        cur = apply_ops(cur, ops, toks, MASK)
    return max_rounds + 1


def test_rounds_to_target_counts_label_rounds_like_a_plain_loop():
    rng = random.Random(5)
    xs, ys = [], []
    for _ in range(300):
        K = 5
        y = [rng.randint(1, 3) for _ in range(K)]
        x = list(y) if rng.random() < 0.2 else [rng.choice([MASK, 1, 2, 3]) for _ in range(K)]
        xs.append(x)
        ys.append(y)
    for max_rounds in (0, 1, 2, 6):
        got = rounds_to_target(torch.tensor(xs), torch.tensor(ys), MASK, max_rounds)
        assert got.dtype == torch.long
        assert got.tolist() == [_plain_rounds(x, y, max_rounds) for x, y in zip(xs, ys)], max_rounds
    assert {0, 1, 2, 7} <= set(rounds_to_target(torch.tensor(xs), torch.tensor(ys), MASK, 6).tolist()) | {7}


def test_ops_from_ids_is_the_inverse_of_label_ids_tokens_included():
    g = torch.Generator().manual_seed(6)
    y = torch.randint(1, 4, (400, 6), generator=g)
    x = torch.randint(0, 4, (400, 6), generator=g)
    ops, toks = lcs_labels(x, y, MASK)
    ops2, toks2 = ops_from_ids(label_ids(ops, toks, DEL_ID, INS_ID), x, DEL_ID, INS_ID)
    edit = (ops == DEL) | (ops == INS)
    assert edit.any() and torch.equal(ops2[edit], ops[edit])
    assert torch.equal(toks2[edit], x[edit])  # DELETE / INSERT carry the position's own token, as lcs_labels
    sub = ops == SUB
    assert torch.equal(toks2[sub], toks[sub]) and ((ops2[sub] == SUB) | (ops2[sub] == KEEP)).all()


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
            levenshtein_draws(bad, ids, resp, None, MASK, DEL_ID, INS_ID)
    with pytest.raises(ValueError, match=r"^levenshtein_draws: length 7 is not a multiple of the block size 4$"):
        n7 = NoiseDraws(noise.masked[..., :7], noise.t, noise.weight[..., :7], 4)
        levenshtein_draws(n7, ids[:, :7], resp[:, :7], None, MASK, DEL_ID, INS_ID)
    drafts = ids.clone()
    drafts[:, 4:8] = torch.tensor([9, 9, 8, 7])  # an edited block: visible non-keep labels
    out = levenshtein_draws(noise, ids, resp, drafts, MASK, DEL_ID, INS_ID)
    assert out.substituted.any() and (out.weight[out.substituted] == 1.0).all()
    assert out.t is noise.t and torch.equal(out.masked, noise.masked)


def test_learner_draws_guards():
    resp, noise = _noise()
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [6, 6, 7, 7, 8, 8, 9, 9]])
    for cfg in (types.SimpleNamespace(mask_token_id=MASK), types.SimpleNamespace(mask_token_id=MASK, delete_token_id=None)):
        with pytest.raises(ValueError, match=r"^learner\.levenshtein: the model's config has no delete_token_id / "
                                             r"insert_token_id$"):
            learner_draws(noise, ids, resp, [2, 2], None, cfg, 1.0)
    cfg = types.SimpleNamespace(mask_token_id=MASK, delete_token_id=DEL_ID, insert_token_id=INS_ID)
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
