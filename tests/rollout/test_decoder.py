"""The batched, cached decoder against the independent plain reference loop (tests/rollout/decode_reference.py)."""
import pytest
import torch

from decode_reference import reference_decode
from conftest import make_model
from rollout import DecodeConfig, generate

# prompt lengths around block boundaries (block 8 and 4): inside a block, exactly on a boundary, spanning blocks
PROMPTS = [[0, 11], [0] + list(range(20, 27)), [0] + list(range(30, 42)), [0] + list(range(50, 65))]


def _check_against_reference(model, prompts, cfg, K):
    outs = generate(model, prompts, cfg)
    stats = []
    for p, o in zip(prompts, outs):
        ref, st = reference_decode(model, p, K, cfg.max_new_tokens, cfg.tau_mask, cfg.tau_edit, cfg.max_post_steps,
                                   cfg.num_to_transfer, cfg.repetition_penalty, cfg.mbe_window, cfg.mbe_tau,
                                   cfg.mbe_max_passes, cfg.stop_at_eos)
        assert o.token_ids == ref, f"prompt len {len(p)}: decoder {o.token_ids} != reference {ref}"
        assert o.num_forwards == st["forwards"]
        assert o.num_edits == st["edits"]
        assert o.num_mbe_edits == st["mbe_edits"]
        assert o.prompt_ids == p
        assert o.tpf == pytest.approx(len(o.token_ids) / o.num_forwards)
        assert len(o.trace) == len(o.token_ids) and min(o.trace) >= 0 and max(o.trace) < o.num_forwards
        stats.append(st)
    return outs, stats


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("preset,block_size", [("quality", None), ("speed", None), ("m2t", None), ("speed", 4)])
def test_batched_decoder_matches_reference(model, preset, block_size, use_cache):
    cfg = DecodeConfig.preset(preset, max_new_tokens=19, block_size=block_size, use_cache=use_cache)
    K = block_size or model.config.block_size
    _, stats = _check_against_reference(model, PROMPTS, cfg, K)
    assert sum(s["fallbacks"] for s in stats) > 0  # the at-least-one-mask fallback was exercised
    if preset == "speed":
        assert sum(s["edits"] for s in stats) > 0  # T2T edits happened


@pytest.mark.parametrize("overrides", [
    dict(tau_mask=0.3, tau_edit=0.2, num_to_transfer=2),
    dict(tau_edit=0.0, repetition_penalty=3.0),
    dict(tau_edit=0.0, max_post_steps=2),
    dict(tau_edit=0.1, max_post_steps=0),
])
def test_more_settings_match_reference(model, overrides):
    cfg = DecodeConfig.preset("quality", max_new_tokens=17, **overrides)
    _check_against_reference(model, PROMPTS[:3], cfg, model.config.block_size)


def test_empty_prompt_decodes(model):
    # not compared token for token: with no prompt all positions of the first block see identical inputs
    # except for RoPE, so confidences tie to ~1e-6 and float noise decides which mask is filled first
    out = generate(model, [[], PROMPTS[0]], DecodeConfig.preset("quality", max_new_tokens=12, stop_at_eos=False))
    assert len(out[0].token_ids) == 12 or out[0].finished_by_eos
    assert model.config.mask_token_id not in out[0].token_ids


def test_eos_stop_and_truncation_match_reference():
    model = make_model(seed=3, eos_boost=25.0)
    cfg = DecodeConfig.preset("speed", max_new_tokens=40)
    outs, _ = _check_against_reference(model, PROMPTS, cfg, model.config.block_size)
    eos = model.config.eos_token_id
    stopped = [o for o in outs if o.finished_by_eos]
    assert stopped, "the EOS-boosted model should stop some sequences"
    for o in stopped:
        assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
    # without the stop, the same sequences run every block: more forwards, same text up to the first EOS
    full = generate(model, PROMPTS, cfg.replace(stop_at_eos=False))
    assert sum(o.num_forwards for o in full) > sum(o.num_forwards for o in outs)


def test_editing_off_is_pure_m2t(model):
    """tau_edit=None reproduces the reference with no T2T at all (LLaDA2.0 decoding), with no post-steps."""
    cfg = DecodeConfig.preset("quality", tau_edit=None, max_new_tokens=16)
    outs, stats = _check_against_reference(model, PROMPTS, cfg, model.config.block_size)
    assert all(o.num_edits == 0 for o in outs)
    negative = generate(model, PROMPTS, cfg.replace(tau_edit=-1.0))
    assert [o.token_ids for o in negative] == [o.token_ids for o in outs]


@pytest.mark.parametrize("use_cache", [True, False])
def test_multi_block_editing_matches_reference(use_cache):
    model = make_model(seed=2)
    cfg = DecodeConfig.preset("speed", max_new_tokens=30, mbe_window=2, mbe_tau=0.3, mbe_max_passes=2,
                              use_cache=use_cache)
    _, stats = _check_against_reference(model, PROMPTS, cfg, model.config.block_size)
    assert sum(s["mbe_edits"] for s in stats) > 0  # MBE revised earlier blocks: the cache was invalidated


def test_mbe_cache_invalidation_equals_no_cache():
    model = make_model(seed=1)
    cfg = DecodeConfig.preset("quality", max_new_tokens=40, mbe_window=1, mbe_tau=0.2, mbe_max_passes=3)
    on = generate(model, PROMPTS, cfg)
    off = generate(model, PROMPTS, cfg.replace(use_cache=False))
    assert sum(o.num_mbe_edits for o in on) > 0
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.trace for o in on] == [o.trace for o in off]


def test_mbe_window_zero_is_plain_decoding(model):
    plain = generate(model, PROMPTS, DecodeConfig.preset("speed", max_new_tokens=24))
    off = generate(model, PROMPTS, DecodeConfig.preset("speed", max_new_tokens=24, mbe_window=0, mbe_tau=0.0))
    assert [(o.token_ids, o.num_forwards) for o in plain] == [(o.token_ids, o.num_forwards) for o in off]


class _Recorder(torch.nn.Module):
    """Wraps a model and records the shape and rows of every forward."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.lm_head, self.calls = model, model.config, model.lm_head, []

    def forward(self, input_ids, **kw):
        rows = kw.get("cache_rows") or list(range(input_ids.shape[0]))
        self.calls.append((input_ids.shape[1], list(rows)))
        return self.model(input_ids, **kw)


def test_finished_sequences_leave_the_batch_and_forwards_count_participation():
    model = make_model(seed=3, eos_boost=25.0)
    rec = _Recorder(model)
    cfg = DecodeConfig.preset("quality", max_new_tokens=40)
    outs = generate(rec, PROMPTS, cfg)
    per_row = [sum(r in rows for _, rows in rec.calls) for r in range(len(PROMPTS))]
    assert per_row == [o.num_forwards for o in outs]
    assert len(rec.calls[-1][1]) < len(PROMPTS)  # early finishers no longer ride along
    K = model.config.block_size
    # with the cache, only the first forward (prompt prefill) may exceed [finished block ; active block]
    assert max(L for L, _ in rec.calls[1:]) <= 2 * K


def test_text_prompts_and_outputs_with_tokenizer(model):
    from ebpo.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    outs = generate(model, ["1+1=", "hello"], DecodeConfig.preset("m2t", max_new_tokens=8), tokenizer=tok)
    ids = [tok("1+1=", add_special_tokens=False)["input_ids"], tok("hello", add_special_tokens=False)["input_ids"]]
    ref = generate(model, ids, DecodeConfig.preset("m2t", max_new_tokens=8))
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert o.text == tok.decode(r.token_ids, skip_special_tokens=True)


def test_bad_inputs_are_named(model):
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        generate(model, [[0, 5], [0, 999]])
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ["text"])
    with pytest.raises(ValueError, match="seeds"):
        generate(model, [[0]], DecodeConfig.preset("speed", temperature=1.0), seeds=[1, 2])


def _sampled(model, prompts, seeds, **kw):
    cfg = DecodeConfig.preset("speed", max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95, **kw)
    return [o.token_ids for o in generate(model, prompts, cfg, seeds=seeds)]


def test_sampling_is_seeded_reproducible_and_batch_independent(model):
    a = _sampled(model, PROMPTS, [1, 2, 3, 4])
    assert a == _sampled(model, PROMPTS, [1, 2, 3, 4])
    assert a != _sampled(model, PROMPTS, [5, 6, 7, 8])
    # the same prompt with the same seed, alone or next to other sequences, gives the same tokens
    assert _sampled(model, [PROMPTS[2]], [3]) == [a[2]]
    # identical prompts with different seeds differ (an RL group is not G copies of one sample)
    group = _sampled(model, [PROMPTS[1]] * 4, [10, 11, 12, 13])
    assert len({tuple(g) for g in group}) > 1


def test_explicit_generators_equal_seeds(model):
    cfg = DecodeConfig.preset("quality", max_new_tokens=12, temperature=1.0)
    gens = [torch.Generator().manual_seed(s) for s in (7, 8)]
    a = generate(model, PROMPTS[:2], cfg, generators=gens)
    b = generate(model, PROMPTS[:2], cfg, seeds=[7, 8])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_on_step_events_replay_the_canvas(model):
    events = []
    cfg = DecodeConfig.preset("speed", max_new_tokens=16)
    outs = generate(model, PROMPTS[:2], cfg, on_step=events.append)
    for seq, o in enumerate(outs):
        mine = [e for e in events if e.seq == seq]
        assert [e.forward for e in mine] == list(range(o.num_forwards))
        assert sum(len(e.edited) for e in mine) == o.num_edits
        P = len(PROMPTS[seq])
        assert mine[-1].finished and mine[-1].canvas[P:P + len(o.token_ids)] == o.token_ids
        # the trace says which forward last wrote each token: that event lists it as filled or edited
        for k, f in enumerate(o.trace):
            ev = mine[f]
            assert P + k in ev.filled or P + k in ev.edited


@pytest.mark.parametrize("side", ["left", "right"])
def test_tensor_batch_with_padding_decodes_like_lists(model, side):
    """A (B, L) tensor with an attention mask (left or right padding) decodes each row as the plain reference
    decodes its unpadded prompt; pad ids that leak in would change the canvas and the tokens."""
    cfg = DecodeConfig.preset("speed", max_new_tokens=10)
    L, pad = max(len(p) for p in PROMPTS), 5
    ids = torch.full((len(PROMPTS), L), pad, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), L, dtype=torch.long)
    for r, p in enumerate(PROMPTS):
        cols = slice(L - len(p), L) if side == "left" else slice(0, len(p))
        ids[r, cols], mask[r, cols] = torch.tensor(p), 1
    outs = generate(model, ids, cfg, attention_mask=mask)
    for p, o in zip(PROMPTS, outs):
        ref, _ = reference_decode(model, p, 8, cfg.max_new_tokens, cfg.tau_mask, cfg.tau_edit, cfg.max_post_steps,
                                  cfg.num_to_transfer, cfg.repetition_penalty, cfg.mbe_window, cfg.mbe_tau,
                                  cfg.mbe_max_passes, cfg.stop_at_eos)
        assert o.prompt_ids == p and o.token_ids == ref


def test_tensor_batch_without_mask_and_bad_shapes(model):
    cfg = DecodeConfig.preset("quality", max_new_tokens=4)
    ids = torch.tensor([PROMPTS[1], PROMPTS[1]])
    outs = generate(model, ids, cfg)
    assert [o.token_ids for o in outs] == [o.token_ids for o in generate(model, [PROMPTS[1]] * 2, cfg)]
    with pytest.raises(ValueError, match="2-D"):
        generate(model, ids[0], cfg)
    with pytest.raises(ValueError, match="must match"):
        generate(model, ids, cfg, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="only accepted with a 2-D tensor"):
        generate(model, [PROMPTS[1]], cfg, attention_mask=torch.ones(1, 8))
