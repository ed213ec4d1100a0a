"""The batched, cached decoder against the independent plain reference loop (tests/support/decode_reference.py).

`rollout.decoder.generate` with the stub model of tests/support/stub_engine_model.py: every documented field of
`GenerationOutput` against the plain reference decoder (tokens cut at max_new_tokens and after the first EOS,
traces, the tail of the last block, counts, logs, TPF, text), the prompt forms it accepts (lists, strings with a
tokenizer, 2-D tensors with or without an attention mask padded on either side) and refuses, per-prompt lengths,
seeds / generators, and that a sequence's tokens depend neither on max_batch nor on its neighbours. The stub's
tests each run in well under a second."""
import pytest
import torch

from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from rollout import DecodeConfig, generate
from rollout.decoder import GenerationOutput
from tests.support.decode_reference import reference_decode
from tests.support.stub_engine_model import EOS, MASK, StubModel, StubTokenizer, V, ref_output, ref_single


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


K = 4


STUB_PROMPTS = [[3, 4, 5], [], [5, 6, 7, 8, 9, 3], [0] * 9]


CASES = {
    "quality": dict(max_post_steps=2),
    "mbe": dict(max_post_steps=1, mbe_window=2, mbe_tau=0.7),
    "lev": dict(max_post_steps=1, tau_delete=0.3, tau_insert=0.3),
    "no-stop": dict(tau_edit=None, stop_at_eos=False),
}


def _check(out, rs, m, prompt):
    want = ref_output(rs, m, K)
    assert isinstance(out, GenerationOutput) and out.prompt_ids == list(prompt)
    for key, value in want.items():
        assert getattr(out, key) == value, key


@pytest.mark.parametrize("name", list(CASES))
def test_generate_outputs_match_the_reference(name):
    stub = StubModel(K=K, seed=5, eos_rate=0.15, lev=name == "lev")
    cfg = DecodeConfig.preset("quality", max_new_tokens=7, **CASES[name])
    tok = StubTokenizer()
    outs = generate(stub, STUB_PROMPTS, cfg, tokenizer=tok, max_batch=2)
    assert len(outs) == len(STUB_PROMPTS)
    for out, p in zip(outs, STUB_PROMPTS):
        rs = ref_single(stub, p, 7, cfg)
        _check(out, rs, 7, p)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    lens = [2, 9, 5, 13]
    outs = generate(stub, STUB_PROMPTS, cfg, max_new_tokens=lens)
    for out, p, m in zip(outs, STUB_PROMPTS, lens):
        _check(out, ref_single(stub, p, m, cfg), m, p)
        assert out.text is None and len(out.token_ids) <= m


def test_eos_cut_and_tail_over_many_seeds():
    """token_ids end at the first EOS (kept) or at max_new_tokens; tail_ids is the rest of that token's block;
    finished_by_eos says which. Seeds where both happen."""
    seen = set()
    for seed in range(8):
        stub = StubModel(K=K, seed=seed, eos_rate=0.35)
        cfg = DecodeConfig.preset("m2t", max_new_tokens=6, stop_at_eos=seed % 2 == 0)
        for out, p in zip(generate(stub, STUB_PROMPTS, cfg), STUB_PROMPTS):
            _check(out, ref_single(stub, p, 6, cfg), 6, p)
            seen.add(out.finished_by_eos)
            if out.finished_by_eos:
                assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
            end = len(p) + len(out.token_ids)
            assert len(out.tail_ids) == (-end) % K
    assert seen == {True, False}


def test_the_default_config_is_the_quality_preset():
    stub = StubModel(K=K, seed=1)
    a = generate(stub, [[3, 4]])
    b = generate(stub, [[3, 4]], DecodeConfig.preset("quality"))
    assert [(o.token_ids, o.trace, o.num_forwards) for o in a] == [(o.token_ids, o.trace, o.num_forwards) for o in b]
    assert len(a[0].token_ids) == 256 or a[0].finished_by_eos


def test_block_size_of_the_config_overrides_the_model_s():
    stub = StubModel(K=K, seed=3)
    cfg = DecodeConfig.preset("m2t", block_size=2, max_new_tokens=5)
    out = generate(stub, [[3, 4, 5]], cfg)[0]
    # the reference with K = 2: a stub of block size 2 and the same table decodes the same way
    stub2 = StubModel(K=2, seed=3)
    rs = ref_single(stub2, [3, 4, 5], 5, cfg)
    want = ref_output(rs, 5, 2)
    assert out.token_ids == want["token_ids"] and out.tail_ids == want["tail_ids"]
    assert out.lev_drafts == [] and out.num_forwards == want["num_forwards"]


def test_prompt_forms():
    """Lists, strings (with a tokenizer), tensors (rows), 2-D tensors with a left- or right-padded attention mask
    decode to the same outputs as the plain lists."""
    stub = StubModel(K=K, seed=2)
    cfg = DecodeConfig.preset("quality", max_new_tokens=5, max_post_steps=1)
    tok = StubTokenizer()
    base = generate(stub, [[3, 4, 5], [6, 7]], cfg)
    key = [(o.token_ids, o.trace, o.prompt_ids) for o in base]

    def keys(outs):
        return [(o.token_ids, o.trace, o.prompt_ids) for o in outs]
    assert keys(generate(stub, ["def", "gh"], cfg, tokenizer=tok)) == key
    assert keys(generate(stub, [torch.tensor([3, 4, 5]), torch.tensor([6, 7])], cfg)) == key
    right = torch.tensor([[3, 4, 5], [6, 7, 0]])
    left = torch.tensor([[3, 4, 5], [0, 6, 7]])
    assert keys(generate(stub, right, cfg, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))) == key
    assert keys(generate(stub, left, cfg, attention_mask=torch.tensor([[True] * 3, [False, True, True]]))) == key
    whole = generate(stub, torch.tensor([[3, 4, 5], [6, 7, 8]]), cfg)
    assert [o.prompt_ids for o in whole] == [[3, 4, 5], [6, 7, 8]]
    assert keys(whole)[0] == key[0]


ONE = "generate: `prompts` must be a list of prompts (token-id lists or strings), not one prompt"


@pytest.mark.parametrize("bad, kw, message", [
    ("ab", {}, ONE),
    (b"ab", {}, ONE),
    ([3, 4], {}, ONE),
    ([], {}, "generate: `prompts` is empty"),
    (["ab"], {}, "generate: prompts[0] is text; pass tokenizer= to encode it"),
    ([[3], [3, V, V + 1, 4]], {}, f"generate: prompts[1] holds token ids outside [0, {V}): [{V}, {V + 1}]"),
    ([[-1, 3]], {}, f"generate: prompts[0] holds token ids outside [0, {V}): [-1]"),
    ([[3, -1, -2, V, -3, -4, -5, -6]], {}, f"generate: prompts[0] holds token ids outside [0, {V}): [-1, -2, {V}, -3, -4]"),
    ([[3], [4]], {"seeds": [1]}, "generate: seeds needs one per prompt (2), got 1"),
    ([[3], [4]], {"generators": [torch.Generator()]}, "generate: generators needs one per prompt (2), got 1"),
    ([[3], [4]], {"max_new_tokens": [3]}, "generate: max_new_tokens needs one length >= 1 per prompt (2), got [3]"),
    ([[3], [4]], {"max_new_tokens": [3, 0]}, "generate: max_new_tokens needs one length >= 1 per prompt (2), got [3, 0]"),
    ([[3]], {"attention_mask": torch.ones(1, 1)}, "generate: attention_mask is only accepted with a 2-D tensor of prompts"),
    (torch.tensor([3, 4]), {}, "generate: a tensor of prompts must be 2-D (batch, length), got shape (2,)"),
    (torch.ones(2, 3, dtype=torch.long), {"attention_mask": torch.ones(2, 2)},
     "generate: attention_mask has shape (2, 2), prompts (2, 3); they must match"),
])
def test_refused_inputs_name_the_problem(bad, kw, message):
    with pytest.raises(ValueError) as err:
        generate(StubModel(K=K), bad, DecodeConfig.preset("m2t", max_new_tokens=2), **kw)
    assert str(err.value) == message


def test_compiled_step_needs_the_cache_and_no_on_step():
    stub = StubModel(K=K)
    with pytest.raises(ValueError, match="compiled_step needs use_cache=true"):
        generate(stub, [[3]], DecodeConfig.preset("m2t", compiled_step=True, use_cache=False))
    with pytest.raises(ValueError, match="on_step needs the eager step"):
        generate(stub, [[3]], DecodeConfig.preset("m2t", compiled_step=True), on_step=lambda e: None)


def test_sampling_depends_only_on_each_prompt_s_seed():
    """temperature > 0: a sequence's tokens come from its own generator only: the same with max_batch 1, 2 or all,
    alone or beside others, with seeds or with generators seeded alike; other seeds give other tokens."""
    stub = StubModel(K=K, seed=6, eos_rate=0.0)
    cfg = DecodeConfig.preset("quality", max_new_tokens=9, temperature=1.5, max_post_steps=1)

    def toks(outs):
        return [(o.token_ids, o.trace, o.num_forwards) for o in outs]
    seeds = [11, 12, 13]
    full = toks(generate(stub, STUB_PROMPTS[:3], cfg, seeds=seeds))
    assert toks(generate(stub, STUB_PROMPTS[:3], cfg, seeds=seeds, max_batch=1)) == full
    assert toks(generate(stub, STUB_PROMPTS[:3], cfg.replace(max_batch=2), seeds=seeds)) == full
    assert toks(generate(stub, [STUB_PROMPTS[1]], cfg, seeds=[12])) == full[1:2]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    assert toks(generate(stub, STUB_PROMPTS[:3], cfg, generators=gens)) == full
    other = toks(generate(stub, STUB_PROMPTS[:3], cfg, seeds=[21, 22, 23]))
    assert other != full
    greedy = toks(generate(stub, STUB_PROMPTS[:3], cfg.replace(temperature=0.0), seeds=seeds))
    assert greedy == toks(generate(stub, STUB_PROMPTS[:3], cfg.replace(temperature=0.0)))
    unseeded = [toks(generate(stub, [STUB_PROMPTS[0]], cfg)) for _ in range(3)]
    assert len({str(u) for u in unseeded}) > 1  # fresh seeds when none are given


def test_sampling_does_not_touch_the_global_generator():
    stub = StubModel(K=K, seed=6)
    cfg = DecodeConfig.preset("quality", max_new_tokens=5, temperature=1.0)
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    generate(stub, [[3, 4]], cfg)
    assert torch.equal(torch.rand(3), want)


def test_max_batch_zero_in_the_config_means_all_prompts_at_once():
    stub = StubModel(K=K, seed=2)
    cfg = DecodeConfig.preset("quality", max_new_tokens=5, max_post_steps=1)
    calls = []
    orig = stub.forward

    def spy(input_ids, **kw):
        calls.append(input_ids.shape[0])
        return orig(input_ids, **kw)
    stub.forward = spy
    generate(stub, STUB_PROMPTS, cfg)
    assert calls[0] == len(STUB_PROMPTS)
    calls.clear()
    generate(stub, STUB_PROMPTS, cfg.replace(max_batch=2))
    assert max(calls) == 2
    calls.clear()
    generate(stub, STUB_PROMPTS, cfg.replace(max_batch=2), max_batch=3)
    assert max(calls) == 3
    calls.clear()
    generate(stub, STUB_PROMPTS, cfg, max_batch=0)
    assert calls[0] == len(STUB_PROMPTS)


def test_on_step_events_and_progress(capsys):
    stub = StubModel(K=K, seed=2)
    cfg = DecodeConfig.preset("quality", max_new_tokens=6, max_post_steps=1)
    events = []
    outs = generate(stub, STUB_PROMPTS[:2], cfg, on_step=events.append, progress=True)
    for i, o in enumerate(outs):
        mine = [e for e in events if e.seq == i]
        assert len(mine) == o.num_forwards and mine[-1].finished
        assert mine[-1].canvas[len(STUB_PROMPTS[i]):len(STUB_PROMPTS[i]) + len(o.token_ids)] == o.token_ids
    assert "decode: 2/2 sequences done" in capsys.readouterr().err
    assert MASK not in outs[0].token_ids


def test_generators_live_on_the_cpu_unless_the_model_is_on_cuda():
    """Seeded generators are made on the model's device only for CUDA; any other device (here `meta`, which has
    no generator) gets CPU generators, seeded with the given seeds."""
    from rollout.decoder import _make_generators

    gens = _make_generators(2, [5, 6], None, 1.0, torch.device("meta"))
    assert [g.device.type for g in gens] == ["cpu", "cpu"]
    assert [g.initial_seed() for g in gens] == [5, 6]
    assert _make_generators(2, [5, 6], None, 0.0, torch.device("meta")) is None
    fresh = _make_generators(3, None, None, 0.5, torch.device("cpu"))
    assert len({g.initial_seed() for g in fresh}) == 3


def test_generators_are_made_on_the_model_s_cuda_device(monkeypatch):
    """A CUDA model's seeded generators are made on its device (its draws then stay there), each with its seed.
    A CPU-only machine cannot make a CUDA generator, so `torch.Generator` is replaced here by a recorder of the
    device asked for; the rule is the one test_generators_live_on_the_cpu_unless_the_model_is_on_cuda pins for
    the other devices."""
    import rollout.decoder as decoder

    made = []

    class Recorder:
        def __init__(self, device=None):
            made.append(device)

        def manual_seed(self, seed):
            self.seed = seed
            return self

    monkeypatch.setattr(decoder.torch, "Generator", Recorder)
    cuda = torch.device("cuda", 1)
    gens = decoder._make_generators(2, [5, 6], None, 1.0, cuda)
    assert made == [cuda, cuda] and [g.seed for g in gens] == [5, 6]
