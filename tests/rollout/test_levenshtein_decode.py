"""Levenshtein decoding (rollout/levenshtein.py): against the plain reference loop, bit for bit today's when off,
cache-independent and batch-independent with shifts."""

import pytest
import torch

from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from tests.support.decode_reference import reference_decode
from rollout import DecodeConfig, generate

PROMPTS = [[0, 11], [0] + list(range(20, 27)), [0] + list(range(30, 42)), [0] + list(range(50, 65))]


def _lev_model(boost=10.0):
    """A random tiny model whose DELETE / INSERT logits are raised, so that both operations fire."""
    model = make_model(seed=1)
    with torch.no_grad():
        w = model.lm_head.weight
        for tid in (model.config.delete_token_id, model.config.insert_token_id):
            w[tid] += boost * w.mean(0) / w.mean(0).norm() * w[tid].norm()
    return model


@pytest.fixture(scope="module")
def lev_model():
    return _lev_model()


def _outs(model, cfg, prompts=PROMPTS, **kw):
    return [(o.token_ids, o.trace, o.num_forwards, o.num_edits, o.edit_log, o.tail_ids)
            for o in generate(model, prompts, cfg, **kw)]


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("overrides", [dict(tau_delete=0.2, tau_insert=0.2), dict(tau_delete=0.1, tau_insert=None),
                                       dict(tau_delete=None, tau_insert=0.1, max_lev_edits=1),
                                       dict(tau_delete=0.15, tau_insert=0.15, tau_edit=0.0, max_lev_edits=3),
                                       dict(tau_delete=0.15, tau_insert=0.1, tau_edit=None)])
def test_levenshtein_decoder_matches_reference(lev_model, overrides, use_cache):
    cfg = DecodeConfig.preset("quality", max_new_tokens=19, use_cache=use_cache, stop_at_eos=False, **overrides)
    K = lev_model.config.block_size
    outs = generate(lev_model, PROMPTS, cfg)
    ops = 0
    for p, o in zip(PROMPTS, outs):
        ref, st = reference_decode(lev_model, p, K, cfg.max_new_tokens, cfg.tau_mask, cfg.tau_edit, cfg.max_post_steps,
                                   cfg.num_to_transfer, stop_at_eos=False, tau_delete=cfg.tau_delete,
                                   tau_insert=cfg.tau_insert, max_lev_edits=cfg.max_lev_edits)
        assert o.token_ids == ref
        assert (o.num_forwards, o.num_edits, o.num_deletes, o.num_inserts) == (
            st["forwards"], st["edits"], st["deletes"], st["inserts"])
        assert lev_model.config.delete_token_id not in o.token_ids and lev_model.config.insert_token_id not in o.token_ids
        assert len(o.trace) == len(o.token_ids) and max(o.trace) < o.num_forwards
        ops += o.num_deletes + o.num_inserts
        assert sum(e[2] in (lev_model.config.delete_token_id, lev_model.config.insert_token_id)
                   for e in o.edit_log) == o.num_deletes + o.num_inserts
    assert ops > 0  # the operations fired


def test_thresholds_off_is_todays_decoding_bit_for_bit(lev_model):
    """Both thresholds off (None or negative) with a model that has the edit tokens = the same weights with a config
    that has none: tokens, traces, forwards, edits and edit logs."""
    plain = make_model(seed=1)
    plain.load_state_dict(lev_model.state_dict())
    plain.config.delete_token_id = plain.config.insert_token_id = None
    for preset in ("quality", "speed"):
        base = DecodeConfig.preset(preset, max_new_tokens=19, stop_at_eos=False)
        want = _outs(plain, base)
        assert _outs(lev_model, base) == want
        assert _outs(lev_model, base.replace(tau_delete=-1.0, tau_insert=None)) == want
    lev_model.config.delete_token_id, lev_model.config.insert_token_id = 105, 106


def test_needs_the_edit_tokens():
    model = make_model(seed=1)
    model.config.delete_token_id = model.config.insert_token_id = None
    with pytest.raises(ValueError, match="delete_token_id"):
        generate(model, PROMPTS[:1], DecodeConfig.preset("quality", max_new_tokens=8, tau_delete=0.5))
    with pytest.raises(ValueError, match="delete_token_id"):
        generate(model, PROMPTS[:1], DecodeConfig.preset("quality", max_new_tokens=8, tau_insert=0.5,
                                                         compiled_step=True))


def test_sampling_with_shifts_is_batch_independent_and_cache_exact(lev_model):
    cfg = DecodeConfig.preset("quality", max_new_tokens=21, temperature=0.9, tau_delete=0.2, tau_insert=0.2,
                              stop_at_eos=False)
    seeds = [5, 6, 7, 8]
    batch = _outs(lev_model, cfg, seeds=seeds)
    alone = [_outs(lev_model, cfg, [p], seeds=[s])[0] for p, s in zip(PROMPTS, seeds)]
    assert batch == alone
    assert _outs(lev_model, cfg.replace(use_cache=False), seeds=seeds) == batch
    outs = generate(lev_model, PROMPTS, cfg, seeds=seeds)
    assert sum(o.num_deletes + o.num_inserts for o in outs) > 0


def test_show_events_carry_the_operations(lev_model):
    events = []
    generate(lev_model, PROMPTS, DecodeConfig.preset("quality", max_new_tokens=19, tau_delete=0.15, tau_insert=0.15),
             on_step=events.append)
    assert any(ev.deleted for ev in events) or any(ev.inserted for ev in events)
    from rollout.show import CanvasView

    view = CanvasView(None, lev_model.config.mask_token_id)
    for ev in events:
        view.update(ev)
    view.render()


def test_pre_edit_drafts_are_recorded_for_l_ebpo(lev_model):
    from ebpo.core.lev_likelihood import drafts_from_rollouts

    K = lev_model.config.block_size
    outs = generate(lev_model, PROMPTS, DecodeConfig.preset("quality", max_new_tokens=19, stop_at_eos=False,
                                                            tau_delete=0.2, tau_insert=0.2))
    assert any(o.lev_drafts for o in outs)
    for p, o in zip(PROMPTS, outs):
        assert bool(o.lev_drafts) == bool(o.num_deletes + o.num_inserts)
        for off, d in o.lev_drafts:
            assert (len(p) + off) % K == 0 and len(d) == K
            assert d[: max(0, -off)] == p[len(p) + off:]  # a block shared with the prompt keeps the prompt
        ids = torch.tensor([p + o.token_ids + o.tail_ids])
        drafts = drafts_from_rollouts(ids, torch.tensor([len(p)]), [o.lev_drafts], K)
        assert drafts.shape == ids.shape


def _label_eprob(ops, K):
    """Edit probabilities that ask for exactly the labelled DELETE / INSERT positions (0.95 there, 0.01 elsewhere)."""
    from ebpo.core.levenshtein import DEL, INS

    e = torch.full((ops.shape[0], K, 2), 0.01)
    e[..., 0] = torch.where(ops == DEL, 0.95, 0.01)
    e[..., 1] = torch.where(ops == INS, 0.95, 0.01)
    return e


def test_the_decoder_applies_every_labelled_operation_but_the_no_ops():
    """Where the LCS labels SFT trains on put DELETE or INSERT, a model that predicts them gets them applied,
    [MASK] positions included (about 1 in 3 INSERT labels sit on one); only a [MASK] followed by nothing but
    [MASK]s is skipped (there both are no-ops). Random drafts against random targets, many shapes."""
    from ebpo.core.levenshtein import DEL, INS, lcs_labels
    from rollout.levenshtein import levenshtein_block_step

    g = torch.Generator().manual_seed(0)
    mask_id, K, B = 1, 8, 400
    cfg = DecodeConfig.preset("quality", tau_delete=0.5, tau_insert=0.5, max_lev_edits=K)
    target = torch.randint(2, 6, (B, K), generator=g)
    draft = torch.randint(2, 6, (B, K), generator=g)
    draft = draft.masked_fill(torch.rand(B, K, generator=g) < 0.3, mask_id)
    ops, _ = lcs_labels(draft, target, mask_id)
    protected = torch.zeros(B, K, dtype=torch.bool)
    tok, prob = torch.full((B, K), 2), torch.zeros(B, K)
    step = levenshtein_block_step(tok, prob, _label_eprob(ops, K), draft, protected, mask_id, cfg)
    is_mask = draft == mask_id
    trailing = torch.tensor([[all(draft[b, j] == mask_id for j in range(i, K)) for i in range(K)] for b in range(B)])
    for code in (DEL, INS):
        want = (ops == code) & ~trailing
        assert torch.equal(step.ops == code, want)
        assert bool((want & is_mask).any())  # the class this pins: labelled operations on [MASK] positions
    # the worked example: draft "3?+2_=6 " (? an inserted token, _ a [MASK]) against "3+2+1=6 "
    d = torch.tensor([[3, 9, 4, 2, mask_id, 5, 6, 7]])
    t = torch.tensor([[3, 4, 2, 4, 8, 5, 6, 7]])
    ex_ops, _ = lcs_labels(d, t, mask_id)
    ex = levenshtein_block_step(torch.full((1, K), 2), torch.zeros(1, K), _label_eprob(ex_ops, K), d,
                                torch.zeros(1, K, dtype=torch.bool), mask_id, cfg)
    assert int(ex_ops[0, 1]) == DEL and int(ex_ops[0, 4]) == INS
    assert torch.equal(ex.ops == DEL, ex_ops == DEL) and torch.equal(ex.ops == INS, ex_ops == INS)


@pytest.mark.parametrize("max_post_steps", [0, 1, 3])
def test_no_mask_is_ever_committed_or_returned(max_post_steps):
    """A policy that inserts often, blocks that reach their forward cap right after an operation: the output and
    the canvas tail the learner scores never hold [MASK], greedy and sampled, with the cache or without."""
    from collections import Counter

    model = _lev_model(boost=14.0)
    mask_id, K = model.config.mask_token_id, model.config.block_size
    per_block: Counter = Counter()
    for temp, cache in [(0.0, True), (1.0, True), (1.0, False)]:
        cfg = DecodeConfig.preset("speed", max_new_tokens=24, temperature=temp, tau_delete=0.05, tau_insert=0.02,
                                  max_lev_edits=3, max_post_steps=max_post_steps, stop_at_eos=False, use_cache=cache)
        outs = generate(model, PROMPTS, cfg, seeds=[1, 2, 3, 4],
                        on_step=lambda ev, t=temp, c=cache: per_block.update([(t, c, ev.seq, ev.block)]))
        for o in outs:
            assert mask_id not in o.token_ids and mask_id not in o.tail_ids
        assert sum(o.num_inserts for o in outs) > 0
    assert max(per_block.values()) >= K + max_post_steps + 1  # some block ran into its forward cap
