"""The mixture objective's counts at their edges, against plain computations (issue 40's real survivors of
ebpo/core/objectives.py): shard accuracies that add up when the model is right somewhere (a random tiny model
restores nothing, so a 0 + 0 = 0 check cannot see a wrong share), MTF rows spread over the shards, an MTF
fraction that rounds to one row, a batch with no masked token, and MTF over a single drafted token."""
import pytest
import torch
import torch.nn.functional as F

from ebpo.core.noise import NoisyBatch, make_noisy, substitution_ids
from ebpo.core.objectives import ObjectiveConfig, mixture_loss, mtf_loss, noisy_half_hidden, shard_of, take_rows
from tests.sft.test_objectives_rules_40 import ADDITIVE, MASK, K, _model

HIT = 8  # the token the biased head always predicts


def _biased_head(model):
    """The tiny model's head plus a large logit on HIT: it predicts HIT everywhere, so it is right exactly
    where the clean token is HIT."""
    bias = torch.zeros(model.config.vocab_size)
    bias[HIT] = 30.0  # the tiny model's logits are O(1): HIT is every argmax
    return lambda h: model.lm_head(h) + bias


def _two_token_batch(B=4, L=16, seed=3):
    """Clean tokens HIT or HIT + 1 only, so accuracies are neither 0 nor 1."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(HIT, HIT + 2, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        resp[i, 1 + i:] = True
    nb = make_noisy(clean, resp, mask_id=MASK, t_min=0.3, t_max=0.8, t2t_rate=0.4,
                    allowed_ids=substitution_ids(128, range(8)), generator=g)
    return clean, resp, nb


@pytest.mark.parametrize("split", [([0, 1], [2, 3]), ([0, 2], [1, 3]), ([3, 0], [2], [1])])
def test_shard_metrics_add_up_when_the_model_is_right_somewhere(split):
    """Every shard divides by the whole batch's counts, so its accuracies and losses are its share: the shards'
    values add up to the whole batch's, for any split (MTF rows 0 and 1 together, apart, or with others)."""
    model = _model()
    head = _biased_head(model)
    clean, resp, nb = _two_token_batch()
    cfg = ObjectiveConfig(t2t_weight=0.7, keep_weight=0.3, mtf_weight=0.4, mtf_fraction=0.5)
    with torch.no_grad():
        whole_loss, whole, _ = mixture_loss(model, head, clean, resp, nb, cfg, K, MASK)
        total, parts = 0.0, dict.fromkeys(ADDITIVE, 0.0)
        for rows in split:
            rows = torch.tensor(rows)
            shard = shard_of(resp, nb, rows, cfg.mtf_fraction)
            loss, m, _ = mixture_loss(model, head, clean[rows], resp[rows], take_rows(nb, rows), cfg, K, MASK,
                                      shard=shard)
            total += float(loss)
            for k in ADDITIVE:
                parts[k] += m[k]
    hit = clean == HIT
    assert whole["acc/t2t_restore"] == pytest.approx(float(hit[nb.substituted].float().mean()), abs=1e-6)
    assert 0.1 < whole["acc/t2t_restore"] < 0.9 and 0.1 < whole["acc/m2t"] < 0.9  # not a vacuous 0 + 0
    # fp32 sums of < 70 CE terms of size up to ~30 (the biased head): 1e-4 is ~50 ulps of the largest sum
    for k in ADDITIVE:
        assert parts[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-4), k
    assert total == pytest.approx(float(whole_loss), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("fraction, rows", [(0.1, 1), (0.3, 1), (0.5, 2), (0.75, 3)])
def test_mtf_takes_the_first_rounded_fraction_of_rows_at_least_one(fraction, rows):
    """MTF runs on the first max(1, round(mtf_fraction * B)) rows: its term is the mean CE of the second pass
    over those rows' drafted (masked) positions, the draft being the first pass's argmax there."""
    model = _model()
    clean, resp, nb = _two_token_batch(seed=7)
    B, L = clean.shape
    cfg = ObjectiveConfig(t2t_weight=0.0, mtf_weight=1.0, mtf_fraction=fraction)
    with torch.no_grad():
        _, m, draft = mixture_loss(model, model.lm_head, clean, resp, nb, cfg, K, MASK)
        logits = model.lm_head(noisy_half_hidden(model, draft[:rows], clean[:rows], K)).float()
    ce = F.cross_entropy(logits.reshape(rows * L, -1), clean[:rows].flatten(), reduction="none").view(rows, L)
    assert m["loss/mtf"] == pytest.approx(float(ce[nb.masked[:rows]].mean()), rel=1e-5)


def test_a_batch_without_masked_tokens_reports_m2t_accuracy_0():
    """No masked token anywhere (only substitutions): acc/m2t is 0.0, a number W&B can plot, not NaN."""
    model = _model()
    clean, resp, _ = _two_token_batch()
    sub = resp & (torch.arange(clean.shape[1]) % 3 == 0)
    nb = NoisyBatch(noisy=torch.where(sub, 50, clean), masked=torch.zeros_like(resp), substituted=sub,
                    kept=resp & ~sub, t=torch.full((clean.shape[0],), 0.5))
    with torch.no_grad():
        _, m, _ = mixture_loss(model, _biased_head(model), clean, resp, nb, ObjectiveConfig(), K, MASK)
    assert m["acc/m2t"] == 0.0 and m["tokens/masked"] == 0.0 and m["loss/m2t"] == 0.0
    assert 0.0 < m["acc/t2t_restore"] < 1.0


def test_mtf_over_one_drafted_token_is_its_cross_entropy():
    """mtf_loss without a denominator is the mean over its drafted tokens: for one token, that token's CE."""
    model = _model()
    clean, _, _ = _two_token_batch(B=1, L=8)
    drafted = torch.zeros_like(clean, dtype=torch.bool)
    drafted[0, 6] = True
    with torch.no_grad():
        got = float(mtf_loss(model, model.lm_head, clean, clean, drafted, K))
        logits = model.lm_head(noisy_half_hidden(model, clean, clean, K)).float()[0]
    assert got == pytest.approx(float(F.cross_entropy(logits[6:7], clean[0, 6:7])), rel=1e-6)
