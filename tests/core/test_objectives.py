"""ebpo.core.objectives: the vectorized [noisy ; clean] loss equals a per-block loop; MTF uses the model's own drafts.

The rules of the SFT mixture loss the per-block tests leave open:

* sharded rows (data-parallel SFT, `shard_of` + `take_rows`): every term is divided by the whole batch's count,
  so the ranks' losses and metrics add up to the whole batch's, including a shard without MTF rows;
* every metric against a plain computation: accuracies (argmax never the mask token), token counts, the total
  loss = m2t + t2t_weight (restore + keep_weight keep) + mtf_weight mtf, and the MTF draft (the noisy input
  with the first pass's argmax at the masks);
* ObjectiveConfig.validate's bounds, each named by its key;
* the counts at their edges: shard accuracies that add up when the model is right somewhere (a random tiny model
  restores nothing, so a 0 + 0 = 0 check cannot see a wrong share), MTF rows spread over the shards, an MTF
  fraction that rounds to one row, a batch with no masked token, and MTF over a single drafted token."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ebpo.core.noise import NoisyBatch, make_noisy, substitution_ids
from ebpo.core.objectives import ObjectiveConfig, mixture_loss, mtf_loss, noisy_half_hidden, shard_of, take_rows
from ebpo.model import LLaDA2MoeModelLM, tiny_config

K = 4


def small_model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=K)
    return LLaDA2MoeModelLM(cfg).eval()


def per_block_logits(model, noisy, clean):
    """Reference: for each block b, run [clean blocks < b ; noisy block b] alone and keep block b's logits."""
    B, L = clean.shape
    out = torch.zeros(B, L, model.config.vocab_size)
    for s in range(0, L, K):
        e = min(s + K, L)
        x = torch.cat([clean[:, :s], noisy[:, s:e]], dim=1)
        logits = model(x, position_ids=torch.arange(e)).logits  # default mask: block-causal
        out[:, s:e] = logits[:, s:e]
    return out


def batch(seed=1, B=3, L=14):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(8, 100, (B, L), generator=g)
    response = torch.zeros(B, L, dtype=torch.bool)
    response[:, 3:] = True
    nb = make_noisy(clean, response, mask_id=2, t_min=0.2, t_max=0.9, t2t_rate=0.3,
                    allowed_ids=substitution_ids(128, range(8)), generator=g)
    return clean, response, nb


def test_vectorized_equals_per_block_loop():
    model = small_model()
    clean, response, nb = batch()  # L=14: the last block is partial
    with torch.no_grad():
        vec = model.lm_head(noisy_half_hidden(model, nb.noisy, clean, K)).float()
        ref = per_block_logits(model, nb.noisy, clean)
    assert torch.allclose(vec, ref, atol=1e-4)


def test_mixture_loss_terms_match_plain_cross_entropy():
    model = small_model()
    clean, response, nb = batch(seed=5)
    cfg = ObjectiveConfig(t2t_weight=0.7, keep_weight=0.3, mtf_weight=0.0)
    with torch.no_grad():
        loss, m, _ = mixture_loss(model, model.lm_head, clean, response, nb, cfg, K, mask_id=2)
        ref = per_block_logits(model, nb.noisy, clean)

    def ce(sel):
        return F.cross_entropy(ref[sel], clean[sel]).item()

    expected = ce(nb.masked) + 0.7 * (ce(nb.substituted) + 0.3 * ce(nb.kept))
    assert abs(m["loss/m2t"] - ce(nb.masked)) < 1e-4
    assert abs(loss.item() - expected) < 1e-4

    elbo = ObjectiveConfig(t2t_weight=0.0, mtf_weight=0.0, normalize="elbo")
    with torch.no_grad():
        loss_e, _, _ = mixture_loss(model, model.lm_head, clean, response, nb, elbo, K, mask_id=2)
    tok = F.cross_entropy(ref.reshape(-1, ref.shape[-1]), clean.reshape(-1), reduction="none").view_as(clean)
    manual = sum(tok[i][nb.masked[i]].sum().item() / nb.t[i].item() for i in range(clean.shape[0])) / response.sum().item()
    assert abs(loss_e.item() - manual) < 1e-4


def test_mtf_second_pass_uses_own_predictions():
    model = small_model(seed=3)
    clean, response, nb = batch(seed=7)
    cfg = ObjectiveConfig(t2t_weight=0.0, mtf_weight=1.0, mtf_fraction=1.0)
    with torch.no_grad():
        loss, m, draft = mixture_loss(model, model.lm_head, clean, response, nb, cfg, K, mask_id=2)
        ref1 = per_block_logits(model, nb.noisy, clean)
        ref1[..., 2] = float("-inf")
        own = ref1.argmax(-1)
        expected_draft = torch.where(nb.masked, own, nb.noisy)
        assert torch.equal(draft, expected_draft)
        ref2 = per_block_logits(model, expected_draft, clean)
    mtf_ref = F.cross_entropy(ref2[nb.masked], clean[nb.masked]).item()
    assert abs(m["loss/mtf"] - mtf_ref) < 1e-4
    assert abs(loss.item() - (m["loss/m2t"] + mtf_ref)) < 1e-4


def test_loss_has_gradients_for_all_terms():
    model = small_model().train()
    clean, response, nb = batch(seed=9)
    loss, _, _ = mixture_loss(model, model.lm_head, clean, response, nb, ObjectiveConfig(), K, mask_id=2)
    loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


MASK = 2


def _model():
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=K)
    return LLaDA2MoeModelLM(cfg).eval()


def _batch(B=4, L=14, seed=1):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(8, 100, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        resp[i, 2 + i:] = True  # different response lengths
    nb = make_noisy(clean, resp, mask_id=MASK, t_min=0.2, t_max=0.9, t2t_rate=0.3,
                    allowed_ids=substitution_ids(128, range(8)), generator=g)
    return clean, resp, nb


ADDITIVE = ["loss/m2t", "loss/t2t_restore", "loss/t2t_keep", "acc/m2t", "acc/t2t_restore", "loss/mtf",
            "acc/mtf_draft", "loss/total", "tokens/masked"]


@pytest.mark.parametrize("normalize", ["token", "elbo"])
def test_shards_add_up_to_the_whole_batch(normalize):
    model = _model()
    clean, resp, nb = _batch()
    cfg = ObjectiveConfig(normalize=normalize, t2t_weight=0.7, keep_weight=0.3, mtf_weight=0.4, mtf_fraction=0.5)
    with torch.no_grad():
        whole, mw, draft_w = mixture_loss(model, model.lm_head, clean, resp, nb, cfg, K, MASK)
        total, ms, drafts = 0.0, dict.fromkeys(ADDITIVE, 0.0), []
        for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):  # the second shard holds no MTF row
            shard = shard_of(resp, nb, rows, cfg.mtf_fraction)
            loss, m, draft = mixture_loss(model, model.lm_head, clean[rows], resp[rows], take_rows(nb, rows), cfg, K,
                                          MASK, shard=shard)
            total += float(loss)
            for k in ADDITIVE:
                ms[k] += m[k]
            drafts.append(draft)
    # fp32 sums of < 60 CE terms of size ~5: 1e-5 is ~100 ulps
    assert abs(total - float(whole)) < 1e-5, (total, float(whole))
    for k in ADDITIVE:
        assert abs(ms[k] - mw[k]) < 1e-5, (k, ms[k], mw[k])
    assert torch.equal(torch.cat(drafts), draft_w)


def test_shard_of_counts_the_whole_batch():
    clean, resp, nb = _batch(B=5)
    for frac, n_mtf in [(0.0, 1), (0.3, 2), (0.5, 2), (1.0, 5)]:  # round(frac * 5), at least 1
        s = shard_of(resp, nb, torch.tensor([4, 0, 2]), frac)
        assert s.counts == {"response": int(resp.sum()), "masked": int(nb.masked.sum()),
                            "substituted": int(nb.substituted.sum()), "kept": int(nb.kept.sum()),
                            "mtf_drafted": int(nb.masked[:n_mtf].sum())}, frac
        assert s.mtf_rows.tolist() == [4 < n_mtf, 0 < n_mtf, 2 < n_mtf]
    sub = take_rows(nb, torch.tensor([3, 1]))
    for f in dataclasses.fields(nb):
        assert torch.equal(getattr(sub, f.name), getattr(nb, f.name)[torch.tensor([3, 1])]), f.name


@pytest.mark.parametrize("normalize, mask_bias", [("token", 0.0), ("elbo", 0.0), ("token", 50.0)])
def test_metrics_and_draft_match_a_plain_computation(normalize, mask_bias):
    """mask_bias: a head whose top logit is the mask token everywhere: the draft and the accuracies take the
    best other token."""
    model = _model()
    clean, resp, nb = _batch(seed=5)
    cfg = ObjectiveConfig(normalize=normalize, t2t_weight=0.7, keep_weight=0.3, mtf_weight=0.4, mtf_fraction=0.5)
    bias = torch.zeros(model.config.vocab_size)
    bias[MASK] = mask_bias

    def head(h):
        return model.lm_head(h) + bias
    with torch.no_grad():
        loss, m, draft = mixture_loss(model, head, clean, resp, nb, cfg, K, MASK)
        logits = head(noisy_half_hidden(model, nb.noisy, clean, K)).float()
    B, L = clean.shape
    ce = F.cross_entropy(logits.reshape(B * L, -1), clean.flatten(), reduction="none").view(B, L)
    pred = logits.clone()
    pred[..., MASK] = float("-inf")
    pred = pred.argmax(-1)
    hit = (pred == clean).float()
    if normalize == "token":
        m2t = ce[nb.masked].mean()
    else:
        m2t = (ce / nb.t[:, None])[nb.masked].sum() / resp.sum()
    restore, keep = ce[nb.substituted].mean(), ce[nb.kept].mean()
    want_draft = torch.where(nb.masked, pred, nb.noisy)
    assert not (want_draft == MASK).any()
    assert torch.equal(draft, want_draft)
    n_mtf = round(0.5 * B)
    with torch.no_grad():
        l2 = head(noisy_half_hidden(model, want_draft[:n_mtf], clean[:n_mtf], K)).float()
    ce2 = F.cross_entropy(l2.reshape(n_mtf * L, -1), clean[:n_mtf].flatten(), reduction="none").view(n_mtf, L)
    mtf = ce2[nb.masked[:n_mtf]].mean()
    want = {"loss/m2t": m2t, "loss/t2t_restore": restore, "loss/t2t_keep": keep, "loss/mtf": mtf,
            "acc/m2t": hit[nb.masked].mean(), "acc/t2t_restore": hit[nb.substituted].mean(),
            "acc/mtf_draft": hit[nb.masked].mean(), "tokens/masked": nb.masked.sum(),
            "loss/total": m2t + 0.7 * (restore + 0.3 * keep) + 0.4 * mtf}
    assert set(m) == set(want)
    for k, v in want.items():
        assert abs(m[k] - float(v)) < 1e-5, (k, m[k], float(v))
    assert abs(float(loss) - m["loss/total"]) < 1e-6


def test_without_t2t_or_mtf_their_terms_are_absent():
    model = _model()
    clean, resp, nb = _batch(seed=6)
    with torch.no_grad():
        loss, m, _ = mixture_loss(model, model.lm_head, clean, resp, nb,
                                  ObjectiveConfig(t2t_weight=0.0, mtf_weight=0.0), K, MASK)
    assert set(m) == {"loss/m2t", "acc/m2t", "loss/total", "tokens/masked"}
    assert abs(float(loss) - m["loss/m2t"]) < 1e-7
    with torch.no_grad():
        _, m, _ = mixture_loss(model, model.lm_head, clean, resp, nb,
                               ObjectiveConfig(t2t_weight=0.5, mtf_weight=0.5, mtf_fraction=0.0), K, MASK)
    assert "loss/mtf" not in m and "loss/t2t_keep" in m


@pytest.mark.parametrize("overrides, key", [
    ({"t_min": 0.0}, "t_min/t_max"), ({"t_min": 0.6, "t_max": 0.5}, "t_min/t_max"), ({"t_max": 1.01}, "t_min/t_max"),
    ({"t2t_rate": 1.0}, "t2t_rate"), ({"t2t_rate": -0.1}, "t2t_rate"),
    ({"mtf_fraction": 1.5}, "mtf_fraction"), ({"mtf_fraction": -0.5}, "mtf_fraction"),
    ({"mbe_weight": 0.1, "mbe_window": 0}, "mbe_window"), ({"mbe_weight": 0.1, "t2t_rate": 0.0}, "mbe_window"),
    ({"lev_source": "other"}, "lev_source"), ({"lev_rate": 1.5}, "lev_rate / lev_fraction / lev_rounds"),
    ({"lev_rate": -0.5}, "lev_rate / lev_fraction / lev_rounds"),
    ({"lev_fraction": 0.0}, "lev_rate / lev_fraction / lev_rounds"),
    ({"lev_fraction": 1.5}, "lev_rate / lev_fraction / lev_rounds"),
    ({"lev_rounds": 0}, "lev_rate / lev_fraction / lev_rounds"),
    ({"t2t_weight": -1e-9}, "t2t_weight"), ({"keep_weight": -1.0}, "keep_weight"), ({"mtf_weight": -1.0}, "mtf_weight"),
    ({"mbe_weight": -1.0}, "mbe_weight"), ({"lev_weight": -1.0}, "lev_weight")])
def test_validate_refuses_each_bound_naming_its_key(overrides, key):
    with pytest.raises(ValueError, match=rf"^objective\.{key}: "):
        ObjectiveConfig(**overrides).validate()


def test_validate_accepts_the_edges():
    edges = [{"t_min": 1.0, "t_max": 1.0}, {"t_min": 1e-6, "t_max": 1e-6}, {"t2t_rate": 0.0}, {"mtf_fraction": 0.0},
             {"mtf_fraction": 1.0}, {"mbe_weight": 0.5, "mbe_window": 1}, {"lev_rate": 0.0}, {"lev_rate": 1.0},
             {"lev_fraction": 1.0}, {"lev_rounds": 1},
             {"t2t_weight": 0.0, "keep_weight": 0.0, "mtf_weight": 0.0, "mbe_weight": 0.0, "lev_weight": 0.0}]
    for overrides in edges + [{"lev_source": s} for s in ("corrupt", "model", "mixed")]:
        ObjectiveConfig(**overrides).validate()


def test_one_masked_token_no_substitution_and_mtf_per_token_default():
    """Edge counts: a batch with exactly one masked token and no substituted one (restore is 0, finite, and the
    graph stays alive); mtf_loss without a denominator is the mean over its drafted tokens."""
    from ebpo.core.noise import NoisyBatch
    from ebpo.core.objectives import mtf_loss
    model = _model()
    clean = torch.randint(8, 100, (1, 8), generator=torch.Generator().manual_seed(2))
    resp = torch.zeros(1, 8, dtype=torch.bool)
    resp[0, 4:] = True
    masked = torch.zeros(1, 8, dtype=torch.bool)
    masked[0, 5] = True
    nb = NoisyBatch(noisy=clean.masked_fill(masked, MASK), masked=masked, substituted=torch.zeros_like(masked),
                    kept=resp & ~masked, t=torch.tensor([0.25]))
    loss, m, _ = mixture_loss(model, model.lm_head, clean, resp, nb, ObjectiveConfig(mtf_weight=0.0), K, MASK)
    logits = model.lm_head(noisy_half_hidden(model, nb.noisy, clean, K)).float()[0]
    ce = F.cross_entropy(logits, clean[0], reduction="none")
    assert abs(m["loss/m2t"] - float(ce[5])) < 1e-5 and m["loss/t2t_restore"] == 0.0
    assert abs(m["loss/t2t_keep"] - float(ce[[4, 6, 7]].mean())) < 1e-5 and torch.isfinite(loss)
    loss.backward()
    drafted = resp.clone()
    got = mtf_loss(model, model.lm_head, clean, clean, drafted, K)
    assert abs(float(got) - float(ce_clean(model, clean)[drafted].mean())) < 1e-5
    assert abs(float(mtf_loss(model, model.lm_head, clean, clean, drafted, K, denominator=2))
               - float(ce_clean(model, clean)[drafted].sum()) / 2) < 1e-5


def ce_clean(model, clean):
    logits = model.lm_head(noisy_half_hidden(model, clean, clean, K)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean.flatten(), reduction="none").view(clean.shape)


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
