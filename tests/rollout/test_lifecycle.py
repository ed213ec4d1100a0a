"""`rollout.lifecycle`: what happens to an engine's sequence between forwards, on a recording engine and runner,
against plain re-statements of each function's docstring: a block starts, a block ends (an MBE window when the
settings ask for one and the turn has an earlier block of the same version; else the next block, a paused turn
or the end), the slot is given back, and a request's settings are checked against what is fixed per engine."""
import random
from collections import deque
from types import SimpleNamespace

import pytest

from rollout import lifecycle
from rollout.config import DecodeConfig
from rollout.sequence import DECODING, FINISHED, MBE, WAITING, Sequence

K, MASK, EOS = 4, 0, 9


class Runner:
    """A runner whose slot holds a canvas list; records every call."""

    def __init__(self, canvas):
        self.canvas, self.calls = list(canvas), []

    def read(self, s, lo, hi):
        self.calls.append(("read", lo, hi))
        return self.canvas[lo:hi]

    def copy_out(self, s, end):
        self.calls.append(("copy_out", end))
        return self.canvas[:end], [7] * end

    def free(self, s):
        self.calls.append(("free", s.slot))

    def reset_block(self, s):
        self.calls.append(("reset_block", s.block))

    def invalidate(self, s, lo, hi):
        self.calls.append(("invalidate", lo, hi))


def _engine(canvas, s, cfg=None, free=(0, 3)):
    return SimpleNamespace(K=K, eos_ids={EOS}, runner=Runner(canvas), active=[s], free=list(free), paused=deque(),
                           cfg=cfg, model=SimpleNamespace(config=SimpleNamespace(block_size=K)), model_lev_ids=None)


def _seq(prompt_len=3, max_new=9, block=1, cfg=None, **kw):
    s = Sequence(id=0, prompt=list(range(1, prompt_len + 1)), max_new=max_new, slot=2, status=DECODING,
                 cfg=cfg or DecodeConfig.preset("quality"), **kw)
    s.num_blocks = -(-(prompt_len + max_new) // K)
    s.block = block
    return s


def test_start_block_restarts_the_counters_in_the_sequence_and_its_slot():
    s = _seq(mbe_start=0, mbe_passes=2, mbe_first_changed=1)
    s.status = MBE
    e = _engine([], s)
    lifecycle.start_block(e, s, 2)
    assert (s.block, s.status, s.mbe_start, s.mbe_passes, s.mbe_first_changed) == (2, DECODING, None, 0, None)
    assert e.runner.calls == [("reset_block", 2)]


def test_release_copies_the_slot_out_frees_it_and_returns_it_in_order():
    s = _seq()
    e = _engine(list(range(20)), s, free=[3, 0])
    lifecycle.release(e, s, 12)
    assert s.canvas == list(range(12)) and s.trace == [7] * 12 and s.status == FINISHED
    assert e.runner.calls == [("copy_out", 12), ("free", 2)]
    assert e.active == [] and e.free == [0, 2, 3]


def _reference_same_version_from(s):
    """The earliest block b of the turn with every block b..s.block decoded under the active block's version."""
    v = s.block_versions.get(s.block)
    return min(b for b in range(s.first_block, s.block + 1)
               if all(s.block_versions.get(j) == v for j in range(b, s.block + 1)))


@pytest.mark.parametrize("seed", range(40))
def test_same_version_from_matches_a_plain_loop(seed):
    rng = random.Random(seed)
    s = _seq(block=rng.randint(0, 7))
    s.first_block = rng.randint(0, s.block)
    s.block_versions = {b: rng.choice([0, 1]) for b in range(s.block + 1) if rng.random() < 0.9}
    assert lifecycle.same_version_from(s) == _reference_same_version_from(s)


@pytest.mark.parametrize("window, block, versions, want_mbe", [
    (0, 3, {}, None),                        # no MBE window: the block just ends
    (2, 3, {}, 1),                           # the window reaches two blocks back
    (5, 3, {}, 0),                           # ... but not before the turn's first block
    (2, 3, {2: 1, 3: 2}, None),              # the block before has another version: nothing to rewrite
    (2, 3, {1: 2, 2: 2, 3: 2}, 1),
    (3, 3, {0: 1, 1: 2, 2: 2, 3: 2}, 1),     # stops at the version change
    (2, 0, {}, None),                        # the turn's first block: no earlier block
])
def test_block_ended_opens_an_mbe_window_only_over_blocks_of_the_same_version(window, block, versions, want_mbe):
    s = _seq(max_new=20, block=block, cfg=DecodeConfig.preset("quality", mbe_window=window, mbe_tau=0.9),
             block_versions=dict(versions))
    e = _engine([1, 2, 3] + [5] * 30, s)
    lifecycle.block_ended(e, s)
    if want_mbe is None:
        assert s.status == DECODING and s.block == block + 1 and s.mbe_start is None  # after_block: next block
    else:
        assert (s.status, s.mbe_start, s.mbe_passes, s.mbe_first_changed, s.block) == (MBE, want_mbe, 0, None, block)
        assert e.runner.calls == []


@pytest.mark.parametrize("first_changed", [None, 0, 1])
def test_after_mbe_invalidates_from_the_first_edited_block_then_goes_on(first_changed):
    s = _seq(max_new=20, block=3, mbe_start=0, mbe_first_changed=first_changed)
    s.status = MBE
    e = _engine([1, 2, 3] + [5] * 30, s)
    lifecycle.after_mbe(e, s)
    calls = e.runner.calls
    assert [c for c in calls if c[0] == "invalidate"] == ([("invalidate", first_changed, 3)]
                                                          if first_changed is not None else [])
    assert calls[-1] == ("reset_block", 4)  # then after_block: the invalidation comes first
    assert s.mbe_start is None and s.status == DECODING and s.block == 4  # after_block: the next block


def _single_turn_reference(canvas, P, max_new, block, num_blocks, stop_at_eos, eos=None):
    """('release', end) or ('next', block): the block's generated region [P, min(P + max_new, end)) read when
    the runner does not know whether it holds EOS."""
    end = (block + 1) * K
    if eos is None:
        eos = any(t == EOS for t in canvas[P:min(P + max_new, end)])
    if (stop_at_eos and eos) or block + 1 >= num_blocks:
        return ("release", num_blocks * K)
    return ("next", block + 1)


@pytest.mark.parametrize("seed", range(60))
def test_after_block_single_turn_matches_the_rule(seed):
    rng = random.Random(seed)
    P, max_new = rng.randint(1, 9), rng.randint(1, 14)
    s = _seq(P, max_new, cfg=DecodeConfig.preset("quality", stop_at_eos=rng.random() < 0.8))
    s.block = rng.randint(P // K, s.num_blocks - 1)
    canvas = [rng.choice([EOS, 5, 6, 6]) for _ in range(s.num_blocks * K + K)]
    eos = rng.choice([None, None, True, False])
    block = s.block
    want = _single_turn_reference(canvas, P, max_new, block, s.num_blocks, s.cfg.stop_at_eos, eos)
    e = _engine(canvas, s)
    lifecycle.after_block(e, s, eos)
    if want[0] == "release":
        assert s.status == FINISHED and s.canvas == canvas[:want[1]] and e.active == []
    else:
        assert s.status == DECODING and s.block == want[1] and ("reset_block", want[1]) in e.runner.calls
    reads = [c for c in e.runner.calls if c[0] == "read"]
    assert reads == ([("read", P, min(P + max_new, (block + 1) * K))] if eos is None else [])


@pytest.mark.parametrize("reason, last, want", [
    (None, False, "next"), (None, True, "budget"), ("eos", False, "eos"), ("tool_call", True, "tool_call")])
def test_after_block_multi_turn_asks_the_turn_rule_and_pauses_for_the_client(reason, last, want):
    seen = []

    def rule(tokens):
        seen.append(list(tokens))
        return reason, "text"

    s = _seq(prompt_len=3, max_new=1, block=2, turn_rule=rule, start=5)
    s.num_blocks = 3 if last else 4  # the active block 2 is the last one / the one before it
    canvas = list(range(40))
    e = _engine(canvas, s)
    lifecycle.after_block(e, s, eos=True)  # eos is for single-turn rows only: the rule reads the turn's tokens
    assert seen == [canvas[5:12]]  # the turn's tokens up to the block's end
    if want == "next":
        assert s.status == DECODING and s.block == 3 and list(e.paused) == []
    else:
        assert (s.status, s.length, s.pause, list(e.paused)) == (WAITING, 12, (want, "text"), [s])
        assert s.block == 2 and s in e.active


def _engine_for(cfg, lev_ids=None, K_model=K):
    e = _engine([], None, cfg=cfg)
    e.model.config.block_size, e.model_lev_ids = K_model, lev_ids
    return e


def test_settings_for_defaults_to_the_engine_s_and_accepts_per_sequence_settings():
    base = DecodeConfig.preset("quality", block_size=K)
    e = _engine_for(base)
    assert lifecycle.settings_for(e, None) is base
    other = DecodeConfig.preset("speed", temperature=0.7, top_k=5, max_new_tokens=3)  # block size: the model's
    assert lifecycle.settings_for(e, other) is other


@pytest.mark.parametrize("engine_kw, request_kw, field", [
    (dict(), dict(block_size=8), "DecodeConfig.block_size"),
    (dict(), dict(use_cache=False), "DecodeConfig.use_cache"),
    (dict(), dict(compiled_step=True), "DecodeConfig.compiled_step"),
    (dict(compiled_step=True), dict(), "DecodeConfig.compiled_step"),
    (dict(compiled_step=True), dict(compiled_step=True, tau_mask=0.5), "DecodeConfig: the compiled step"),
    (dict(), dict(tau_delete=0.5, tau_insert=0.5), "DecodeConfig.tau_delete / tau_insert"),
])
def test_settings_for_refuses_what_is_fixed_per_engine_naming_the_field(engine_kw, request_kw, field):
    e = _engine_for(DecodeConfig.preset("quality", **engine_kw))
    with pytest.raises(ValueError) as err:
        lifecycle.settings_for(e, DecodeConfig.preset("quality", **request_kw))
    assert str(err.value).startswith(field)


def test_settings_for_the_compiled_step_lets_only_the_length_differ():
    cfg = DecodeConfig.preset("quality", compiled_step=True, max_new_tokens=64, max_batch=4)
    e = _engine_for(cfg)
    req = cfg.replace(max_new_tokens=5, max_batch=1)
    assert lifecycle.settings_for(e, req) is req


def test_settings_for_levenshtein_needs_the_model_s_edit_tokens():
    req = DecodeConfig.preset("quality", tau_delete=0.5, tau_insert=0.5)
    assert lifecycle.settings_for(_engine_for(DecodeConfig.preset("quality"), lev_ids=(10, 11)), req) is req
