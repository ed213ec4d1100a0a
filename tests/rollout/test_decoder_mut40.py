"""`rollout.decoder.generate` with the stub model of tests/rollout/stub_engine_model.py: every documented field
of `GenerationOutput` against the plain reference decoder (tokens cut at max_new_tokens and after the first EOS,
traces, the tail of the last block, counts, logs, TPF, text), the prompt forms it accepts (lists, strings with a
tokenizer, 2-D tensors with or without an attention mask padded on either side) and refuses, per-prompt lengths,
seeds / generators, and that a sequence's tokens depend neither on max_batch nor on its neighbours (issue 40's
mutation run of rollout/decoder.py). Each test runs in well under a second."""
import pytest
import torch
from stub_engine_model import EOS, MASK, V, StubModel, StubTokenizer, ref_output, ref_single

from rollout import DecodeConfig, generate
from rollout.decoder import GenerationOutput

K = 4
PROMPTS = [[3, 4, 5], [], [5, 6, 7, 8, 9, 3], [0] * 9]

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
    outs = generate(stub, PROMPTS, cfg, tokenizer=tok, max_batch=2)
    assert len(outs) == len(PROMPTS)
    for out, p in zip(outs, PROMPTS):
        rs = ref_single(stub, p, 7, cfg)
        _check(out, rs, 7, p)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    lens = [2, 9, 5, 13]
    outs = generate(stub, PROMPTS, cfg, max_new_tokens=lens)
    for out, p, m in zip(outs, PROMPTS, lens):
        _check(out, ref_single(stub, p, m, cfg), m, p)
        assert out.text is None and len(out.token_ids) <= m


def test_eos_cut_and_tail_over_many_seeds():
    """token_ids end at the first EOS (kept) or at max_new_tokens; tail_ids is the rest of that token's block;
    finished_by_eos says which. Seeds where both happen."""
    seen = set()
    for seed in range(8):
        stub = StubModel(K=K, seed=seed, eos_rate=0.35)
        cfg = DecodeConfig.preset("m2t", max_new_tokens=6, stop_at_eos=seed % 2 == 0)
        for out, p in zip(generate(stub, PROMPTS, cfg), PROMPTS):
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
    full = toks(generate(stub, PROMPTS[:3], cfg, seeds=seeds))
    assert toks(generate(stub, PROMPTS[:3], cfg, seeds=seeds, max_batch=1)) == full
    assert toks(generate(stub, PROMPTS[:3], cfg.replace(max_batch=2), seeds=seeds)) == full
    assert toks(generate(stub, [PROMPTS[1]], cfg, seeds=[12])) == full[1:2]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    assert toks(generate(stub, PROMPTS[:3], cfg, generators=gens)) == full
    other = toks(generate(stub, PROMPTS[:3], cfg, seeds=[21, 22, 23]))
    assert other != full
    greedy = toks(generate(stub, PROMPTS[:3], cfg.replace(temperature=0.0), seeds=seeds))
    assert greedy == toks(generate(stub, PROMPTS[:3], cfg.replace(temperature=0.0)))
    unseeded = [toks(generate(stub, [PROMPTS[0]], cfg)) for _ in range(3)]
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
    generate(stub, PROMPTS, cfg)
    assert calls[0] == len(PROMPTS)
    calls.clear()
    generate(stub, PROMPTS, cfg.replace(max_batch=2))
    assert max(calls) == 2
    calls.clear()
    generate(stub, PROMPTS, cfg.replace(max_batch=2), max_batch=3)
    assert max(calls) == 3
    calls.clear()
    generate(stub, PROMPTS, cfg, max_batch=0)
    assert calls[0] == len(PROMPTS)


def test_on_step_events_and_progress(capsys):
    stub = StubModel(K=K, seed=2)
    cfg = DecodeConfig.preset("quality", max_new_tokens=6, max_post_steps=1)
    events = []
    outs = generate(stub, PROMPTS[:2], cfg, on_step=events.append, progress=True)
    for i, o in enumerate(outs):
        mine = [e for e in events if e.seq == i]
        assert len(mine) == o.num_forwards and mine[-1].finished
        assert mine[-1].canvas[len(PROMPTS[i]):len(PROMPTS[i]) + len(o.token_ids)] == o.token_ids
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
