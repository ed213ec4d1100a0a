"""`rollout.engine_holder.EngineHolder`: a client's one long-lived engine, against its documented rule.

A call gets the held engine when it fits (same block size, prefix cache and compiled step; canvas and slots at
least the call's; for the compiled step the same settings but max_new_tokens / max_batch); otherwise a new engine,
grown to the larger of the old and the new canvas / slots when the fixed settings are the same, built fresh when
they differ. Each call's settings, callbacks and an empty list of finished sequences; a weight version that the
engine and every later engine start from. The decode of a held engine is the decode of a fresh one (the stub
model's plain reference decoder, tests/support/stub_engine_model.py).
"""
import pytest

import rollout.compiled as compiled
from rollout.config import DecodeConfig
from rollout.engine import Engine
from rollout.engine_holder import EngineHolder
from rollout.sequence import FINISHED
from tests.support.stub_engine_model import StubModel, ref_single

K = 4


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)  # the step uncompiled: same graph, no torch.compile time


def _cfg(**kw):
    return DecodeConfig.preset("quality", **{"max_new_tokens": 8, **kw})


def _shape(e):
    return e.K, e.T, e.max_batch, e.cfg.use_cache, e.cfg.compiled_step


def _fits(e, cfg, canvas_len, max_batch):
    """The documented rule, written out: the held engine serves the call."""
    same_step = (not cfg.compiled_step
                 or e.cfg.replace(max_new_tokens=1, max_batch=0) == cfg.replace(max_new_tokens=1, max_batch=0))
    return ((e.K, e.cfg.use_cache, e.cfg.compiled_step) == (cfg.block_size or K, cfg.use_cache, cfg.compiled_step)
            and e.T >= canvas_len and e.max_batch >= max_batch and same_step)


CALLS = [  # (cfg, canvas_len, max_batch)
    (_cfg(), 16, 2),
    (_cfg(max_new_tokens=4), 12, 1),          # fits: the same engine
    (_cfg(), 24, 2),                            # longer canvas: grown, slots kept
    (_cfg(), 8, 5),                             # more slots: grown, canvas kept
    (_cfg(), 40, 1),                            # longer again: grown, the 5 slots kept
    (_cfg(tau_mask=0.5), 20, 3),                # other per-sequence thresholds: the same (eager) engine
    (_cfg(use_cache=False), 8, 1),              # another engine-wide choice: fresh, not grown
    (_cfg(), 8, 1),                             # back to the cache: fresh again, sized for the call
    (_cfg(block_size=8), 16, 1),                # another block size
    (_cfg(compiled_step=True), 16, 2),          # the compiled step
    (_cfg(compiled_step=True, max_new_tokens=3), 16, 2),   # only the length differs: the same step
    (_cfg(compiled_step=True, tau_mask=0.5), 16, 2),       # another threshold: a new step
]


def test_each_call_gets_the_held_engine_when_it_fits_else_a_new_one_grown_by_the_rule():
    holder = EngineHolder(StubModel(K))
    prev, builds = None, 0
    for cfg, canvas_len, max_batch in CALLS:
        e = holder.get(cfg, canvas_len=canvas_len, max_batch=max_batch)
        if prev is not None and _fits(prev, cfg, canvas_len, max_batch):
            assert e is prev, (cfg, canvas_len, max_batch)
        else:
            builds += 1
            assert e is not prev
            Kc = cfg.block_size or K
            grow = prev is not None and (prev.K, prev.cfg.use_cache, prev.cfg.compiled_step) == \
                (Kc, cfg.use_cache, cfg.compiled_step)
            want_T = max(canvas_len, prev.T if grow else 0)
            want_T = -(-want_T // Kc) * Kc  # the engine rounds its canvas up to whole blocks
            assert (e.T, e.max_batch) == (want_T, max(max_batch, prev.max_batch if grow else 0))
        assert e.cfg is cfg and holder.engine is e and holder.rebuilds == builds
        prev = e
    assert builds == 9


def test_each_call_gets_its_callbacks_and_no_finished_sequence_of_an_earlier_call():
    holder = EngineHolder(StubModel(K))
    events = []
    e = holder.get(_cfg(), canvas_len=16, max_batch=2, on_step=events.append, progress=True)
    assert (e.on_step, e.progress) == (events.append, True)
    e.on_step, e.progress = None, False
    done = e.submit([3, 4, 5])
    e.run()
    assert done.status == FINISHED and e.sequences == [done]
    again = holder.get(_cfg(), canvas_len=16, max_batch=2)
    assert again is e and again.sequences == [] and (again.on_step, again.progress) == (None, False)


@pytest.mark.parametrize("prompt", [[3, 4, 5], [5, 6, 7, 8, 9, 3], [0] * 9])
def test_a_held_engine_decodes_what_a_fresh_engine_and_the_reference_decode(prompt):
    """Earlier calls (other settings) leave nothing behind: the third call's tokens are the plain reference
    decoder's with the third call's settings."""
    stub = StubModel(K)
    holder = EngineHolder(stub)
    cfg, earlier = _cfg(max_new_tokens=10), DecodeConfig.preset("speed", max_new_tokens=10)
    for p in ([1, 2], [7, 7, 7, 7, 7]):  # two earlier calls on the same engine
        e = holder.get(earlier, canvas_len=32, max_batch=2)
        e.submit(p)
        e.run()
    e = holder.get(cfg, canvas_len=32, max_batch=2)
    (s,) = [e.submit(prompt)]
    e.run()
    fresh = Engine(stub, cfg, max_batch=2, canvas_len=32)
    f = fresh.submit(prompt)
    fresh.run()
    ref = ref_single(stub, prompt, 10, cfg)
    assert ref_single(stub, prompt, 10, earlier).trace != ref.trace  # the settings matter here
    assert s.canvas == f.canvas == ref.x[:ref.num_blocks * K] and s.trace == f.trace == ref.trace[:ref.num_blocks * K]
    assert holder.rebuilds == 1


def test_set_version_reaches_the_held_engine_and_every_later_one():
    holder = EngineHolder(StubModel(K), version=3)
    assert holder.version == 3 and holder.engine is None
    holder.set_version(4)  # no engine yet: only recorded
    e = holder.get(_cfg(), canvas_len=16, max_batch=1)
    assert e.version == 4
    holder.set_version(5)
    assert holder.version == 5 and e.version == 5
    s = e.submit([3, 4, 5])
    e.run()
    assert set(s.block_versions.values()) == {5}
    bigger = holder.get(_cfg(), canvas_len=64, max_batch=1)
    assert bigger is not e and bigger.version == 5
