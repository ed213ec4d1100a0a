"""The fixed-shape decode step (`DecodeConfig.compiled_step`, rollout/compiled.py) against the eager decoder.

1. Run uncompiled, the step gives the eager decoder's tokens, forward counts, edit counts and traces, bit for
   bit, for every preset, sampling, the repetition penalty, EOS stops and several batch shapes.
2. `torch.compile(fullgraph=True)` captures it as one graph (a graph break would raise) and decoding a batch
   whose rows finish at different blocks never recompiles (`error_on_recompile`); a second call with the same
   shapes reuses the graph. The default test traces with the `aot_eager` backend (same graph, eager kernels:
   identical traces, about 20 s on 2 CPU cores); the slow one compiles with inductor (1-2 min on CPU) and
   checks the tokens.
"""
import pytest
import torch
import torch._dynamo as dynamo
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from torch._dynamo.utils import counters

import rollout.compiled as compiled
from rollout import DecodeConfig, generate

# 2, not 0: an all-[MASK] first block (an empty prompt) has positions that differ only by their rotary phases, so
# their confidences tie to within float rounding and which one the M2T fallback fills depends on the BLAS path
# (eager and compiled shapes differ); a 2-token prompt takes the same no-previous-block path of the step
PROMPT_LENS = (3, 8, 13, 2, 21)


def _prompts(lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]


def _same(a, b, trace=True):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert (x.num_forwards, x.num_edits, x.finished_by_eos) == (y.num_forwards, y.num_edits, y.finished_by_eos)
        assert x.tail_ids == y.tail_ids
        if trace:
            assert x.trace == y.trace


@pytest.fixture()
def uncompiled(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


@pytest.mark.parametrize("preset", ["quality", "speed", "m2t"])
@pytest.mark.parametrize("extra", [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20}, {"repetition_penalty": 3.0},
                                   {"max_post_steps": 0, "num_to_transfer": 2}])
def test_static_step_equals_eager_decoder(model, uncompiled, preset, extra):
    cfg = DecodeConfig.preset(preset, max_new_tokens=40, **extra)
    seeds = list(range(len(PROMPT_LENS)))
    eager = generate(model, _prompts(), cfg, seeds=seeds)
    _same(eager, generate(model, _prompts(), cfg.replace(compiled_step=True), seeds=seeds))
    if preset == "speed" and not extra:
        assert sum(o.num_edits for o in eager) > 0  # T2T edits happen


def test_static_step_eos_stop_and_block_sizes(uncompiled):
    model = make_model(seed=1, eos_boost=6.0)
    for cfg in (DecodeConfig.preset("quality", max_new_tokens=48),
                DecodeConfig.preset("m2t", max_new_tokens=20, block_size=4),
                DecodeConfig.preset("speed", max_new_tokens=30, stop_at_eos=False)):
        eager = generate(model, _prompts((1, 6, 17)), cfg)
        _same(eager, generate(model, _prompts((1, 6, 17)), cfg.replace(compiled_step=True)))
    assert any(o.finished_by_eos for o in generate(model, _prompts((1, 6, 17)), DecodeConfig.preset("quality")))


def test_unsupported_settings_are_named(model):
    with pytest.raises(ValueError, match="use_cache"):
        generate(model, [[5, 6]], DecodeConfig(compiled_step=True, use_cache=False))
    with pytest.raises(ValueError, match="on_step"):
        generate(model, [[5, 6]], DecodeConfig(compiled_step=True), on_step=lambda ev: None)


def _lev_model():
    model = make_model(seed=1)
    with torch.no_grad():
        w = model.lm_head.weight
        for tid in (model.config.delete_token_id, model.config.insert_token_id):
            w[tid] += 10.0 * w.mean(0) / w.mean(0).norm() * w[tid].norm()
    return model


@pytest.mark.parametrize("extra", [dict(mbe_window=2, mbe_tau=0.2), dict(early_commit=0.3),
                                   dict(mbe_window=1, mbe_tau=0.3, temperature=1.0, max_batch=2)])
def test_mbe_and_early_commit_run_in_the_compiled_step(model, uncompiled, extra):
    """MBE passes (eager, over the compiled step's cache refills) and early commit: the eager loop's tokens,
    counts and traces; with max_batch 2, sequences join freed slots mid-run (prompt blocks refilled)."""
    cfg = DecodeConfig.preset("speed", max_new_tokens=40, **extra)
    seeds = list(range(len(PROMPT_LENS)))
    eager = generate(model, _prompts(), cfg, seeds=seeds)
    _same(eager, generate(model, _prompts(), cfg.replace(compiled_step=True), seeds=seeds))
    if "mbe_window" in extra:
        assert sum(o.num_mbe_edits for o in eager) > 0  # the MBE passes changed tokens (refills exercised)


@pytest.mark.parametrize("max_batch", [0, 2])
def test_levenshtein_runs_in_the_compiled_step(uncompiled, max_batch):
    """DELETE / INSERT inside the fixed-shape step: the eager loop's tokens, traces, counts and pre-edit drafts."""
    lev = _lev_model()
    cfg = DecodeConfig.preset("quality", max_new_tokens=40, tau_delete=0.2, tau_insert=0.2, max_batch=max_batch)
    eager = generate(lev, _prompts(), cfg)
    comp = generate(lev, _prompts(), cfg.replace(compiled_step=True))
    _same(eager, comp)
    assert sum(o.num_deletes + o.num_inserts for o in eager) > 0
    for a, b in zip(eager, comp):
        assert (a.num_deletes, a.num_inserts, a.lev_drafts) == (b.num_deletes, b.num_inserts, b.lev_drafts)


def _compile_and_check(model, monkeypatch, backend, trace):
    monkeypatch.setattr(compiled, "BACKEND", backend)
    monkeypatch.setattr(compiled, "_COMPILED", {})
    dynamo.reset()
    counters.clear()
    cfg = DecodeConfig.preset("quality", max_new_tokens=40)
    eager = generate(model, _prompts(), cfg)
    with dynamo.config.patch(error_on_recompile=True):
        first = generate(model, _prompts(), cfg.replace(compiled_step=True))
        again = generate(model, _prompts(seed=1), cfg.replace(compiled_step=True))  # same shapes, new prompts
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    _same(eager, first, trace)
    _same(generate(model, _prompts(seed=1), cfg), again, trace)
    blocks = [o.num_forwards for o in first]
    assert min(blocks) < max(blocks)  # rows finished after different numbers of iterations, in several blocks


def test_compiled_step_is_one_graph_without_recompiles(model, monkeypatch):
    _compile_and_check(model, monkeypatch, "aot_eager", trace=True)


@pytest.mark.slow
def test_inductor_compiled_step_gives_the_eager_tokens(model, monkeypatch):
    """Inductor's fused kernels round differently from eager ones, so a near-tie may be decided at another
    iteration (the trace can differ); the tokens and counts of these prompts are the same."""
    _compile_and_check(model, monkeypatch, "inductor", trace=False)
