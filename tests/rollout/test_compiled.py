"""rollout/compiled.py, fast.

Pure parts against plain references: the candidate maths with given noise, the canvas length, the unsupported
settings, the per-row noise, the EOS check of the generated region, the compile cache (with torch.compile
replaced by a recorder). The step itself, run uncompiled (`COMPILE = False`), against the eager decoder on the
tiny model with short outputs: the documented rule is the eager loop's tokens, forward counts, edit counts and
traces, bit for bit (tests/rollout/test_compiled_step.py checks more settings, slower).
"""
import math
from types import SimpleNamespace

import pytest
import torch
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve

import rollout.compiled as compiled
from rollout import DecodeConfig, generate
from rollout.compiled import (StaticDecodeStep, _candidates, canvas_length, check_supported, compiled_step,
                              draw_noise)
from rollout.sampling import candidates_reference

TINY = torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.6),
                                                     (1.0, 4, 0.8)])
@pytest.mark.parametrize("penalty", [0.0, 2.5])
def test_candidates_equal_the_eager_reference_on_the_same_uniforms(temperature, top_k, top_p, penalty):
    B, K, V = 3, 4, 11
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K, V, generator=g) * 2
    suppress = torch.randint(-1, V, (B, K), generator=g) if penalty else None
    seeds = [5, 6, 7]
    noise = torch.stack([torch.rand(K, V, generator=torch.Generator().manual_seed(s)) for s in seeds])
    tok, prob = _candidates(logits, noise, temperature, top_k, top_p, suppress, penalty)
    gens = [torch.Generator().manual_seed(s) for s in seeds] if temperature > 0 else None
    rtok, rprob = candidates_reference(logits, temperature, top_k, top_p, gens, suppress, penalty)
    assert torch.equal(tok, rtok)
    torch.testing.assert_close(prob, rprob, rtol=1e-6, atol=1e-7)
    assert prob.dtype == torch.float32


def test_candidates_penalty_by_hand():
    logits = torch.tensor([[[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]]])
    suppress = torch.tensor([[0, -1]])  # position 0 penalises token 0, position 1 nothing
    tok, prob = _candidates(logits, None, 0.0, 0, 1.0, suppress, 2.0)
    assert tok.tolist() == [[1, 0]]
    x0 = torch.tensor([1.0, 2.0, 0.0])
    assert math.isclose(prob[0, 0].item(), x0.softmax(-1)[1].item(), rel_tol=1e-6)
    assert math.isclose(prob[0, 1].item(), logits[0, 1].softmax(-1)[0].item(), rel_tol=1e-6)
    tok, _ = _candidates(logits, None, 0.0, 0, 1.0, suppress, 0.0)  # penalty 0: nothing changes
    assert tok.tolist() == [[0, 0]]
    tok, _ = _candidates(logits.double(), None, 0.0, 0, 1.0, None, 2.0)  # no targets: nothing changes
    assert tok.tolist() == [[0, 0]]


def test_zero_uniform_is_clamped_not_minus_infinity():
    """A uniform of exactly 0 is the smallest positive float (Gumbel about -4.5), as the eager path draws it: a
    token far ahead still wins."""
    logits = torch.tensor([[[40.0, 0.0, 0.0]]])
    noise = torch.tensor([[[0.0, 0.5, 0.5]]])
    tok, prob = _candidates(logits, noise, 1.0, 0, 1.0, None, 0.0)
    assert tok.item() == 0
    assert -math.log(-math.log(TINY)) > -5


def test_temperature_scales_before_the_noise():
    logits = torch.tensor([[[2.0, 0.0]]])
    g0 = -math.log(-math.log(0.5))
    u1 = math.exp(-math.exp(-(g0 + 1.5)))  # Gumbel of token 1 = g0 + 1.5
    noise = torch.tensor([[[0.5, u1]]])
    assert _candidates(logits, noise, 1.0, 0, 1.0, None, 0.0)[0].item() == 0  # 2 + g0 > 0 + g0 + 1.5
    tok, prob = _candidates(logits, noise, 4.0, 0, 1.0, None, 0.0)  # 0.5 + g0 < g0 + 1.5
    assert tok.item() == 1
    assert math.isclose(prob.item(), torch.tensor([0.5, 0.0]).softmax(-1)[1].item(), rel_tol=1e-6)


@pytest.mark.parametrize("K", [1, 4, 8, 32])
def test_canvas_length(K):
    for lens in ([0], [1, 7], [5, 40, 3], [K * 16], [K * 16 - 1, 1]):
        for m in (1, 5, 64):
            need = max(math.ceil((P + m) / K) for P in lens)
            want = math.ceil(need / compiled.BUCKET_BLOCKS) * compiled.BUCKET_BLOCKS * K
            got = canvas_length(lens, m, K)
            assert got == want and got % (K * 16) == 0 and got >= max(lens) + m


def test_check_supported():
    check_supported(DecodeConfig(), None)
    with pytest.raises(ValueError) as err:
        check_supported(DecodeConfig(use_cache=False), None)
    assert str(err.value) == ("DecodeConfig.compiled_step needs use_cache=true (the step attends a fixed-size KV "
                              "cache)")
    with pytest.raises(ValueError) as err:
        check_supported(DecodeConfig(), lambda ev: None)
    assert str(err.value) == ("generate: on_step needs the eager step (compiled_step=false): the compiled step "
                              "keeps every sequence's per-forward decisions on the device")


def test_draw_noise():
    shape = (3, 5)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    states = [g.get_state() for g in gens]
    out = draw_noise(gens, [True, False, True], shape, "cpu")
    assert out.shape == (3, *shape) and out.dtype == torch.float32
    assert torch.equal(out[0], torch.rand(shape, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(out[1], torch.zeros(shape))
    assert torch.equal(out[2], torch.rand(shape, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(gens[1].get_state(), states[1])  # a row not live draws nothing
    again = draw_noise(gens, [True, True, True], shape, "cpu")  # the generators moved on
    assert not torch.equal(again[0], out[0])
    assert torch.equal(again[1], torch.rand(shape, generator=torch.Generator().manual_seed(2)))
    meta = draw_noise([torch.Generator().manual_seed(1)], [True], shape, "meta")
    assert meta.device.type == "meta" and meta.shape == (1, *shape)


def test_draw_noise_draws_on_each_generator_s_device_whatever_the_default_device():
    """Each row is drawn where its generator lives (a generator draws only on its own device), then moved to
    `device`: under a `meta` default device, CPU generators still give the CPU draws (a draw on the default device
    would be `meta`, with no values to move)."""
    gens = [torch.Generator().manual_seed(s) for s in (8, 9)]
    with torch.device("meta"):
        out = draw_noise(gens, [True, True], (2, 3), "cpu")
    assert out.device.type == "cpu"
    for b, s in enumerate((8, 9)):
        assert torch.equal(out[b], torch.rand((2, 3), generator=torch.Generator().manual_seed(s)))


def test_draw_noise_draws_float32_as_the_eager_path_whatever_the_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = draw_noise([torch.Generator().manual_seed(4)], [True], (6, 7), "cpu")
    finally:
        torch.set_default_dtype(old)
    want = torch.rand((6, 7), generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    assert torch.equal(out[0].float(), want)


def _step(K=4, T=32, max_post_steps=3, eos=(9, 2), lev=None, batch=3):
    cache = SimpleNamespace(k=[torch.zeros(batch, 1)])
    return StaticDecodeStep(object(), DecodeConfig(max_post_steps=max_post_steps), K, T, 7, set(eos), cache, lev)


def test_init():
    s = _step(K=4, T=32, max_post_steps=3, eos={9, 2, 5}, lev=(3, 4))
    assert (s.K, s.T, s.mask_id, s.eos, s.block_cap, s.lev_ids) == (4, 32, 7, [2, 5, 9], 4 + 3 + 1, (3, 4))
    assert s.cfg.max_post_steps == 3 and s.cache.k[0].shape[0] == 3


def test_has_eos_counts_only_the_generated_region():
    K, T = 4, 32
    s = _step(K=K, T=T, eos=(9, 2))
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        B = 5
        canvas = torch.randint(0, 12, (B, T), generator=g)
        canvas[canvas == 9] = 0
        canvas[canvas == 2] = 1
        start = torch.randint(0, 12, (B,), generator=g)
        block = start // K + torch.randint(0, 3, (B,), generator=g)
        limit = torch.randint(1, 10, (B,), generator=g)
        for b in range(B):  # one EOS near the region's edges per row
            where = int(torch.randint(max(int(start[b]) - 1, 0), min(T, (int(block[b]) + 1) * K + 1), (1,), generator=g))
            canvas[b, where] = [9, 2][b % 2]
        got = s._has_eos(canvas, block, start, limit)
        for b in range(B):
            end = min(int(start[b]) + int(limit[b]), (int(block[b]) + 1) * K)
            want = any(int(canvas[b, p]) in (9, 2) for p in range(int(start[b]), end))
            assert int(got[b]) == int(want), (b, canvas[b].tolist(), start[b], block[b], limit[b])
        assert got.dtype == torch.long


def test_compiled_step_cache(monkeypatch):
    made = []

    def fake_compile(fn, **kw):
        made.append((fn, kw))
        return lambda step, *args: ("compiled", fn.__name__, step(*args))

    monkeypatch.setattr(compiled.torch, "compile", fake_compile)
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(compiled, "COMPILE", True)

    class Step(StaticDecodeStep):
        def __call__(self, *args):
            return ("ran", args)

    def step(K=4, batch=3, cfg=DecodeConfig(), lev=None, model=None):
        cache = SimpleNamespace(k=[torch.zeros(batch, 1)])
        return Step(model or shared_model, cfg, K, 32, 7, {1}, cache, lev)

    shared_model = object()
    a = compiled_step(step())
    assert a(1, 2) == ("compiled", "_decode_step_0", ("ran", (1, 2)))
    (fn, kw), = made
    assert kw == dict(fullgraph=True, dynamic=False, backend=compiled.BACKEND, mode=compiled.MODE)
    assert fn.__code__.co_name == "_decode_step_0" and fn.__name__ == "_decode_step_0"
    compiled_step(step())(0)  # same model, settings and shapes: the compiled graph is reused
    assert len(made) == 1
    for other in (dict(K=8), dict(batch=2), dict(cfg=DecodeConfig(tau_mask=0.6)), dict(lev=(3, 4)),
                  dict(model=object())):
        n = len(made)
        assert compiled_step(step(**other))(5)[:2] == ("compiled", f"_decode_step_{n}")
    assert len(made) == 6 and len(compiled._COMPILED) == 6
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    compiled_step(step())
    monkeypatch.setattr(compiled, "MODE", "reduce-overhead")
    compiled_step(step())
    assert len(made) == 8 and made[-1][1] == dict(fullgraph=True, dynamic=False, backend="aot_eager",
                                                  mode="reduce-overhead")
    monkeypatch.setattr(compiled, "COMPILE", False)
    s = step()
    assert compiled_step(s) is s and len(made) == 8


# --- the step, uncompiled, against the eager decoder -------------------------------------------------------

@pytest.fixture()
def uncompiled(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]


def _same(model, prompts, cfg, seeds=None):
    eager = generate(model, prompts, cfg, seeds=seeds)
    comp = generate(model, prompts, cfg.replace(compiled_step=True), seeds=seeds)
    for x, y in zip(eager, comp):
        assert x.token_ids == y.token_ids
        assert (x.num_forwards, x.num_edits, x.finished_by_eos) == (y.num_forwards, y.num_edits, y.finished_by_eos)
        assert (x.num_deletes, x.num_inserts, x.lev_drafts) == (y.num_deletes, y.num_inserts, y.lev_drafts)
        assert x.tail_ids == y.tail_ids and x.trace == y.trace
    return eager


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_step_equals_eager_greedy(model, uncompiled):
    out = _same(model, _prompts((3, 9, 0, 12)), DecodeConfig.preset("speed", max_new_tokens=16))
    assert sum(o.num_edits for o in out) > 0


def test_step_equals_eager_sampling_and_penalty(model, uncompiled):
    # prompts of 0 and 1 tokens: generated positions 0 and 1, whose previous token is none / the canvas's first
    _same(model, _prompts((0, 1, 10)), DecodeConfig.preset("quality", max_new_tokens=16, temperature=0.9, top_k=20,
                                                           top_p=0.9, repetition_penalty=3.0), seeds=[3, 4, 5])
    # greedy on an empty prompt: every position of the all-[MASK] first block has the same confidence to within
    # float rounding, so the fallback's pick among them is a tie that the BLAS path decides; filling the whole
    # block in the first forward (num_to_transfer = K) leaves the penalty's rule, not a tie, to decide the edits
    _same(model, _prompts((0, 1)), DecodeConfig.preset("speed", max_new_tokens=8, repetition_penalty=6.0,
                                                       num_to_transfer=model.config.block_size))


def test_step_equals_eager_transfer_and_no_post_steps(model, uncompiled):
    _same(model, _prompts((4, 11)), DecodeConfig.preset("m2t", max_new_tokens=16, max_post_steps=0,
                                                        num_to_transfer=2, tau_mask=0.99))


def test_step_equals_eager_early_commit_and_eos(uncompiled):
    eos_model = make_model(seed=1, eos_boost=6.0)
    out = _same(eos_model, _prompts((1, 6, 9)), DecodeConfig.preset("quality", max_new_tokens=24, block_size=4,
                                                                     early_commit=0.3))
    assert any(o.finished_by_eos for o in out)
    _same(eos_model, _prompts((1, 6)), DecodeConfig.preset("speed", max_new_tokens=12, stop_at_eos=False,
                                                          max_batch=1))


def test_step_equals_eager_levenshtein(uncompiled):
    lev = make_model(seed=1)
    with torch.no_grad():
        w = lev.lm_head.weight
        for tid in (lev.config.delete_token_id, lev.config.insert_token_id):
            w[tid] += 10.0 * w.mean(0) / w.mean(0).norm() * w[tid].norm()
    out = _same(lev, _prompts((3, 9, 0)), DecodeConfig.preset("quality", max_new_tokens=16, tau_delete=0.2,
                                                              tau_insert=0.2))
    assert sum(o.num_deletes + o.num_inserts for o in out) > 0


class RecordingModel:
    """Records the step's forward; hidden states on the canvas's device, a linear head."""

    def __init__(self, B, K, H, V, device):
        self.B, self.K, self.H, self.device, self.calls = B, K, H, device, []
        self.lm_head = torch.nn.Linear(H, V, bias=False).to(device)

    def __call__(self, input_ids, **kw):
        self.calls.append(dict(input_ids=input_ids, **kw))
        return SimpleNamespace(last_hidden_state=torch.arange(self.B * 2 * self.K * self.H, dtype=torch.float32,
                                                              device=self.device).view(self.B, 2 * self.K, self.H))


def _inputs(B, T, K, V, device, block):
    d = device
    z = torch.zeros(B, dtype=torch.long, device=d)
    return dict(canvas=torch.randint(8, V, (B, T), generator=torch.Generator().manual_seed(0)).to(d),
                trace=torch.zeros(B, T, dtype=torch.long, device=d), post_steps=z.clone(), block_iters=z.clone(),
                block=torch.tensor(block, device=d), start=z.clone(), limit=torch.full((B,), 8, device=d),
                forwards=z.clone(), active=torch.ones(B, dtype=torch.bool, device=d),
                noise=torch.zeros(B, K, V, device=d))


def test_window_forward_inputs_against_the_layout_rule():
    """Per row: the previous block (or, in block 0, dummy slots in the spare tail T..T+K) then the active block,
    at absolute positions; the previous block's queries see the committed prefix (before the active block), the
    active block's queries everything up to its end; keys/values written at the window's slots; hidden states
    only (the step applies the head to the active block itself)."""
    B, K, T, H, V = 4, 4, 16, 3, 20
    model = RecordingModel(B, K, H, V, "cpu")
    cache = SimpleNamespace(k=[torch.zeros(B, 1)], write_pos=None)
    step = StaticDecodeStep(model, DecodeConfig(), K, T, 7, {1}, cache, None)
    blocks = [0, 1, 3, 2]  # block 3 is the canvas's last: its last slot is T - 1
    x = _inputs(B, T, K, V, "cpu", blocks)
    x["canvas"][2, T - 2:] = torch.tensor([9, 10])  # unequal: reading the wrong last slot would show
    hidden = step._window_hidden(x["canvas"], x["block"])
    (call,) = model.calls
    assert call["return_logits"] is False and call["cache"] is cache
    assert torch.equal(hidden, model(None).last_hidden_state[:, K:])
    for b, blk in enumerate(blocks):
        act = list(range(blk * K, blk * K + K))
        win = (list(range(blk * K - K, blk * K)) if blk > 0 else list(range(T, T + K))) + act
        assert cache.write_pos[b].tolist() == win
        # the active half: the canvas's tokens at their positions, every key up to the block's end
        assert call["input_ids"][b, K:].tolist() == x["canvas"][b, act].tolist()
        assert call["position_ids"][b, K:].tolist() == act
        keep = call["attention_mask"][b, 0]
        assert keep.shape == (2 * K, T + K)
        for q in range(K, 2 * K):
            assert keep[q].tolist() == [j < blk * K + K for j in range(T + K)]
        if blk > 0:  # the previous block, recomputed: its tokens, positions, and the prefix before the active block
            assert call["input_ids"][b, :K].tolist() == x["canvas"][b, win[:K]].tolist()
            assert call["position_ids"][b, :K].tolist() == win[:K]
            for q in range(K):
                assert keep[q].tolist() == [j < blk * K for j in range(T + K)]
        else:  # dummy queries in the spare tail: they see only the tail, which no real query sees
            assert all(keep[q, T:].all() and not keep[q, :T].any() for q in range(K))
            assert not keep[K:, T:].any()


@pytest.mark.parametrize("cfg", [DecodeConfig(repetition_penalty=2.0), DecodeConfig(temperature=0.5, top_k=3)])
@pytest.mark.parametrize("lev", [None, (3, 4)])
def test_step_keeps_to_the_canvas_device(cfg, lev):
    """Every tensor the step makes goes to the canvas's device (`meta` stands in for an accelerator: mixing it
    with a CPU tensor raises, as a CUDA tensor does)."""
    B, K, T, H, V = 3, 4, 32, 5, 20
    model = RecordingModel(B, K, H, V, "meta")
    cache = SimpleNamespace(k=[torch.zeros(B, 1)], write_pos=None)
    step = StaticDecodeStep(model, cfg, K, T, 7, {1}, cache, lev)
    x = _inputs(B, T, K, V, "meta", [0, 1, 2])
    outcome, cur = step(*x.values())
    assert outcome.device.type == "meta" and outcome.shape == (B, 6) and cur.shape == (B, K)
    assert cache.write_pos.device.type == "meta"


def test_outcome_columns_of_one_step():
    """The step's outcome per slot: (block done, wrote, EOS, T2T edits, DELETEs, INSERTs). Slot 0 decodes a block of
    masks (at least one M2T write), slot 1 takes no part, slot 2's block is full and T2T is off (nothing written)."""
    B, K, T, H, V, MASK = 3, 4, 32, 3, 20, 7
    model = RecordingModel(B, K, H, V, "cpu")
    cache = SimpleNamespace(k=[torch.zeros(B, 1)], write_pos=None)
    step = StaticDecodeStep(model, DecodeConfig(tau_edit=None, max_post_steps=2), K, T, MASK, {1}, cache, None)
    x = _inputs(B, T, K, V, "cpu", [1, 1, 1])
    x["canvas"][x["canvas"] == MASK] = 9
    x["canvas"][0, K:2 * K] = MASK
    x["canvas"][1, K:2 * K] = MASK
    x["active"] = torch.tensor([True, False, True])
    before = x["canvas"].clone()
    outcome, cur = step(*x.values())
    assert outcome[:, 1].tolist() == [1, 0, 0]  # wrote: only where an active slot wrote a token
    assert (x["canvas"][0, K:2 * K] != MASK).sum() >= 1 and torch.equal(x["canvas"][1:], before[1:])
    assert outcome[:, 3].tolist() == [0, 0, 0] and outcome[:, 4:].tolist() == [[0, 0]] * 3
    assert torch.equal(cur, before[:, K:2 * K])
