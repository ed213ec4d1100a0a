"""Partial rollouts in the engine: stop every sequence at a block boundary (`drain`), hand the in-flight ones to
an engine holding new weights (`export` / `adopt`), continue. The rule under test: each block is decoded under
one weight version, and a block's tokens are exactly what that version decodes given the blocks before it.

The reference is the independent plain loop of tests/support/decode_reference.py, run in two parts: the first model for the
blocks the first engine decoded, then the second model with everything decoded so far as its prompt."""
import pytest
import torch

from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from rollout import DecodeConfig
from rollout.engine import Engine
from rollout.sequence import FINISHED
from tests.support.decode_reference import reference_decode


PROMPTS = [[0, 11], [0] + list(range(20, 27)), [0] + list(range(30, 42)), [0] + list(range(50, 65)), [0, 5, 6]]


def _ref(model, prompt, K, n_new, cfg):
    toks, _ = reference_decode(model, prompt, K, n_new, cfg.tau_mask, cfg.tau_edit, cfg.max_post_steps,
                               cfg.num_to_transfer, cfg.repetition_penalty, cfg.mbe_window, cfg.mbe_tau,
                               cfg.mbe_max_passes, cfg.stop_at_eos)
    return toks


def _engine(model, cfg, version, T):
    return Engine(model, cfg, max_batch=len(PROMPTS), canvas_len=T, version=version)


def _switch_after(model_a, model_b, cfg, forwards_before_switch):
    """Decode PROMPTS with model_a for a few forwards, drain, continue the unfinished ones with model_b."""
    K = cfg.block_size or model_a.config.block_size
    T = max(-(-(len(p) + cfg.max_new_tokens) // K) * K for p in PROMPTS)
    first = _engine(model_a, cfg, 0, T)
    seqs = [first.submit(p) for p in PROMPTS]
    for _ in range(forwards_before_switch):
        first.step()
    first.drain()
    assert all(s.at_block_boundary for s in first.active)
    carried = first.export()
    second = _engine(model_b, cfg, 1, T)
    second.submit([0, 3, 4, 5])  # a sequence decoded first: the adopted ones take slots whose cache was used
    second.run()
    for s in carried:
        second.adopt(s)
    second.run()
    return seqs, K


@pytest.mark.parametrize("preset,mbe", [("quality", 0), ("speed", 0), ("speed", 2)])
@pytest.mark.parametrize("forwards_before_switch", [1, 3, 6])
def test_a_switch_at_block_boundaries_equals_the_two_part_reference(preset, mbe, forwards_before_switch):
    model_a, model_b = make_model(0), make_model(1)
    cfg = DecodeConfig.preset(preset, max_new_tokens=29, mbe_window=mbe)
    seqs, K = _switch_after(model_a, model_b, cfg, forwards_before_switch)
    switched = 0
    for p, s in zip(PROMPTS, seqs):
        assert s.status == FINISHED
        versions = s.versions_by_block()
        decoded = [b for b, v in enumerate(versions) if v >= 0]
        # every block from the prompt's last one to the end was decoded, under 0 then 1, never back
        assert decoded == list(range(len(p) // K, len(versions)))
        assert [versions[b] for b in decoded] == sorted(versions[b] for b in decoded)
        gen = s.canvas[len(p):len(p) + cfg.max_new_tokens]
        n_first = sum(v == 0 for v in versions)
        if 1 not in versions:  # finished under the first weights: the one-model reference
            ref = _ref(model_a, p, K, cfg.max_new_tokens, cfg)
            assert gen[:len(ref)] == ref
            continue
        switched += 1
        split = (len(p) // K + n_first) * K  # first position decoded under the second weights
        part1 = _ref(model_a, p, K, split - len(p), cfg) if split > len(p) else []
        assert gen[:split - len(p)] == part1, "blocks of version 0 differ from the first model's reference"
        part2 = _ref(model_b, p + part1, K, cfg.max_new_tokens - len(part1), cfg)
        assert gen[split - len(p):split - len(p) + len(part2)] == part2
    assert switched >= 2  # the switch happened in the middle of several sequences


def test_drain_holds_rows_at_the_boundary_and_admits_nothing():
    model = make_model(0)
    cfg = DecodeConfig.preset("speed", max_new_tokens=29, max_batch=2)
    K = model.config.block_size
    engine = Engine(model, cfg, max_batch=2, canvas_len=64, version=3)
    seqs = [engine.submit(p) for p in PROMPTS]
    engine.step()
    engine.step()
    started = {s.id: dict(s.block_versions) for s in seqs}
    engine.drain()
    for s in engine.active:
        assert s.at_block_boundary
        # the drain finished the blocks already started and started none
        assert set(s.block_versions) == set(started[s.id]) and s.block not in s.block_versions
    assert len(engine.queue) == len(PROMPTS) - 2
    out = engine.export()
    assert {s.id for s in out} == {s.id for s in seqs if s.status != FINISHED}
    assert all(v == 3 for s in seqs for v in s.block_versions.values())
    assert not engine.active and sorted(engine.free) == [0, 1]
    assert all(len(s.canvas) == engine.T or s.slot is None for s in out)
    del K


def test_mbe_never_rewrites_a_block_of_an_older_version():
    """With MBE on and a very eager MBE threshold, a block of the first version keeps its tokens after the switch."""
    model_a, model_b = make_model(0), make_model(2)
    cfg = DecodeConfig.preset("speed", max_new_tokens=29, mbe_window=4, mbe_tau=0.0, mbe_max_passes=2)
    seqs, K = _switch_after(model_a, model_b, cfg, 4)
    checked = 0
    for p, s in zip(PROMPTS, seqs):
        versions = s.versions_by_block()
        if 1 not in versions or 0 not in versions:
            continue
        end0 = max(b for b, v in enumerate(versions) if v == 0) + 1
        part1 = _ref(model_a, p, K, end0 * K - len(p), cfg)
        assert s.canvas[len(p):end0 * K] == part1
        checked += 1
    assert checked >= 2


def test_adopt_refuses_a_sequence_in_the_middle_of_a_block():
    model = make_model(0)
    cfg = DecodeConfig.preset("quality", max_new_tokens=29)
    engine = Engine(model, cfg, max_batch=2, canvas_len=64)
    s = engine.submit(PROMPTS[2])
    engine.step()
    assert not s.at_block_boundary or s.status == FINISHED
    other = Engine(model, cfg, max_batch=2, canvas_len=64)
    s.canvas = engine.runner.slots.canvas[s.slot].tolist()
    with pytest.raises(ValueError, match="block boundary"):
        other.adopt(s)


@pytest.mark.parametrize("compiled_step", [False, True])
def test_a_sampled_sequence_continues_its_own_generator(monkeypatch, compiled_step):
    """Sampling: the adopted sequence draws from the generator it had, so a run with a switch between two copies of
    the same weights gives the tokens of a run without one; also through the compiled step's cache refills (run
    uncompiled here: tests/rollout/test_compiled_step.py checks that compiling changes nothing)."""
    import rollout.compiled as compiled

    monkeypatch.setattr(compiled, "COMPILE", False)
    model = make_model(0)
    cfg = DecodeConfig.preset("speed", max_new_tokens=29, temperature=0.8, compiled_step=compiled_step)
    K = model.config.block_size
    T = max(-(-(len(p) + cfg.max_new_tokens) // K) * K for p in PROMPTS)

    def gens():
        return [torch.Generator().manual_seed(100 + i) for i in range(len(PROMPTS))]

    plain = Engine(model, cfg, max_batch=len(PROMPTS), canvas_len=T)
    ref = [plain.submit(p, g) for p, g in zip(PROMPTS, gens())]
    plain.run()
    first = Engine(model, cfg, max_batch=len(PROMPTS), canvas_len=T)
    seqs = [first.submit(p, g) for p, g in zip(PROMPTS, gens())]
    for _ in range(3):
        first.step()
    first.drain()
    second = Engine(model, cfg, max_batch=len(PROMPTS), canvas_len=T, version=1)
    for s in first.export():
        second.adopt(s)
    second.run()
    for r, s in zip(ref, seqs):
        assert s.canvas == r.canvas
    assert any(1 in s.versions_by_block() for s in seqs)
