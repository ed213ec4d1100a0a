"""ebpo/core functions that make tensors keep them on their inputs' (or generator's) device: under a `meta` default
device, with the model, inputs and generators on the CPU, each returns exactly what it returns without one (a
tensor made on the default device would be `meta` and fail where it meets the CPU ones). The rule a second device
shows, checked on a CPU-only machine (issue 40's device survivors once judged "CPU-only equivalent")."""
import contextlib
import types

import pytest
import torch

from ebpo.core.editing import add_substitutions, choose_positions
from ebpo.core.lev_likelihood import learner_draws, levenshtein_draws
from ebpo.core.lev_objective import levenshtein_loss
from ebpo.core.likelihood import NoiseDraws, draw_noise
from ebpo.core.objectives import ObjectiveConfig, noisy_half_hidden

MASK, DEL, INS, K = 2, 105, 106, 4


def _under(default_device):
    return torch.device(default_device) if default_device else contextlib.nullcontext()


def _batch(B=3, L=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate([3, 6, 1][:B]):
        resp[b, p:] = True
    return ids, resp, draw_noise(resp, K, 3, 0.2, 0.9, torch.Generator().manual_seed(seed + 1))


def _same(want, got):
    if isinstance(want, torch.Tensor):
        assert got.device.type == "cpu" and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, NoiseDraws):
        for f in ("masked", "t", "weight", "substituted", "sub_ids", "noisy_ids", "targets"):
            _same(getattr(want, f), getattr(got, f))
    elif isinstance(want, dict):
        assert got == want
    else:
        assert want is None and got is None


def test_noisy_half_hidden_and_editing_draws(small_model):
    ids, resp, noise = _batch()
    allowed = torch.arange(10, 60)
    outs = {}
    for dev in (None, "meta"):
        with torch.no_grad(), _under(dev):
            outs[dev] = (noisy_half_hidden(small_model, ids.masked_fill(resp, MASK), ids, K),
                         choose_positions(noise, resp, 0.5, torch.Generator().manual_seed(3)),
                         add_substitutions(noise, ids, resp, rate=0.5, weight=0.7, source="uniform",
                                           allowed_ids=allowed, generator=torch.Generator().manual_seed(4)),
                         add_substitutions(noise, ids, resp, rate=0.5, weight=0.7, source="mixed",
                                           allowed_ids=allowed, generator=torch.Generator().manual_seed(5),
                                           model=small_model, mask_token_id=MASK))
    for w, g in zip(outs[None], outs["meta"]):
        _same(w, g)
    assert outs[None][1].any() and outs[None][2].substituted.any()


def test_levenshtein_draws_and_the_learner_s():
    ids, resp, noise = _batch()
    drafts = ids.clone()
    drafts[:, 8:10] = ids[:, 9:11]  # a shifted stretch: DELETE / INSERT labels
    cfg = types.SimpleNamespace(mask_token_id=MASK, delete_token_id=DEL, insert_token_id=INS)
    noise14 = draw_noise(resp[:, :14], K, 3, 0.2, 0.9, torch.Generator().manual_seed(9))  # a partial last block
    outs = {}
    for dev in (None, "meta"):
        with _under(dev):
            outs[dev] = (levenshtein_draws(noise, ids, resp, drafts, MASK, DEL, INS, weight=0.5),
                         learner_draws(noise14, ids[:, :14], resp[:, :14], [3, 6, 1],
                                       [[(5, ids[0, 8:12].tolist())], [], []], cfg, 1.0))
    for w, g in zip(outs[None], outs["meta"]):
        _same(w, g)
    assert ((outs[None][0].targets == DEL) | (outs[None][0].targets == INS)).any()


@pytest.mark.parametrize("source", ["corrupt", "mixed"])
def test_levenshtein_loss(small_model, source):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 60, (3, 16), generator=g)
    resp = torch.zeros(3, 16, dtype=torch.bool)
    resp[:, 4:] = True
    first = clean.masked_fill(resp, MASK)
    cfg = ObjectiveConfig(lev_weight=1.0, lev_source=source, lev_rate=0.5, lev_rounds=2, lev_fraction=1.0)
    allowed, outs = torch.arange(10, 60), {}
    for dev in (None, "meta"):
        with torch.no_grad(), _under(dev):
            outs[dev] = levenshtein_loss(small_model, small_model.lm_head, clean, resp, first, cfg, K, MASK, DEL, INS,
                                         allowed, torch.Generator().manual_seed(1))
    _same(outs[None][0], outs["meta"][0])
    _same(outs[None][1], outs["meta"][1])
