"""Rules of the SFT mixture loss that the per-block tests leave open (issue 40):

* sharded rows (data-parallel SFT, `shard_of` + `take_rows`): every term is divided by the whole batch's count,
  so the ranks' losses and metrics add up to the whole batch's, including a shard without MTF rows;
* every metric against a plain computation: accuracies (argmax never the mask token), token counts, the total
  loss = m2t + t2t_weight (restore + keep_weight keep) + mtf_weight mtf, and the MTF draft (the noisy input
  with the first pass's argmax at the masks);
* ObjectiveConfig.validate's bounds, each named by its key.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ebpo.core.noise import make_noisy, substitution_ids
from ebpo.core.objectives import ObjectiveConfig, mixture_loss, noisy_half_hidden, shard_of, take_rows
from ebpo.model import LLaDA2MoeModelLM, tiny_config

K, MASK = 4, 2


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
