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
from conftest import make_model
from torch._dynamo.utils import counters

import rollout.compiled as compiled
from rollout import DecodeConfig, generate

PROMPT_LENS = (3, 8, 13, 0, 21)


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
    with pytest.raises(ValueError, match="Multi-Block Editing"):
        generate(model, [[5, 6]], DecodeConfig(compiled_step=True, mbe_window=1))
    with pytest.raises(ValueError, match="use_cache"):
        generate(model, [[5, 6]], DecodeConfig(compiled_step=True, use_cache=False))
    with pytest.raises(ValueError, match="on_step"):
        generate(model, [[5, 6]], DecodeConfig(compiled_step=True), on_step=lambda ev: None)


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
