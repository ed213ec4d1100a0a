"""The rollout engine (`rollout.engine.Engine`) against a plain-Python reference decoder, driven by a stub model whose
logits are a function of what each position attends (tests/support/stub_engine_model.py): block by block
draft-and-edit decoding with every documented rule (M2T with its fallback, T2T, post-steps, the forward cap, early
commit, DELETE / INSERT, Multi-Block Editing, EOS, per-row max_new_tokens), continuous batching (admission into
freed slots, the forward counts), the per-forward events, weight versions and the MBE window they bound, drain /
export / adopt. Multi-turn rollouts and the compiled step's bookkeeping are in test_multiturn.py of this folder.
Each test runs in well under a second."""
import re

import pytest

from rollout import DecodeConfig
from rollout.engine import Engine, eos_ids_of
from rollout.sequence import DECODING, FINISHED, QUEUED
from tests.support.stub_engine_model import EOS, MASK, StubModel, ref_single


K = 4


PROMPTS = [[3, 4, 5], [], [5, 6, 7, 8, 9, 3], [0] * 9, [7, 7, 7, 7]]


MAX_NEW = [5, 8, 3, 11, 6]


CASES = {
    "quality": dict(max_post_steps=2),
    "quality-no-cache": dict(max_post_steps=2, use_cache=False),
    "m2t-two-per-step": dict(tau_edit=None, num_to_transfer=2),
    "speed-early-commit": dict(tau_mask=0.5, tau_edit=0.0, max_post_steps=1, early_commit=0.9),
    "early-commit-low": dict(max_post_steps=3, early_commit=0.7),
    "no-post-steps": dict(max_post_steps=0),
    "mbe-1": dict(max_post_steps=2, mbe_window=1, mbe_tau=0.7, mbe_max_passes=3),
    "mbe-2-no-cache": dict(max_post_steps=1, mbe_window=2, mbe_tau=0.7, use_cache=False),
    "mbe-high-tau": dict(max_post_steps=1, mbe_window=3, mbe_tau=0.9, mbe_max_passes=1),
    "no-stop-at-eos": dict(max_post_steps=1, stop_at_eos=False),
    "lev": dict(max_post_steps=2, tau_delete=0.3, tau_insert=0.3, max_lev_edits=1),
    "lev-delete-only-no-edit": dict(tau_edit=None, max_post_steps=1, tau_delete=0.3),
    "lev-mbe": dict(max_post_steps=1, tau_insert=0.3, tau_delete=0.6, mbe_window=1, mbe_tau=0.7),
}


def exact(message):
    """A pytest `match` pattern for exactly this message."""
    return "^" + re.escape(message) + "$"


def _stub(name, seed=0, eos_rate=0.12):
    return StubModel(K=K, seed=seed, eos_rate=eos_rate, lev="lev" in name)


def _cfg(name, **kw):
    return DecodeConfig.preset("quality", **{**CASES[name], **kw})


def _run_engine(stub, cfg, prompts, max_new, max_batch, **kw):
    T = max(-(-(len(p) + m) // K) * K for p, m in zip(prompts, max_new))
    eng = Engine(stub, cfg, max_batch=max_batch, canvas_len=T, **kw)
    seqs = [eng.submit(p, max_new_tokens=m) for p, m in zip(prompts, max_new)]
    return eng, seqs


def _cache_lengths_at_release(eng):
    """{sequence id: its cache row's length when it left its slot}: the runner gives a finished row's keys/values
    back (`free`), so what it had committed is read just before."""
    seen, free = {}, eng.runner.free

    def recording_free(s):
        seen[s.id] = eng.runner.cache.lengths[s.slot]
        return free(s)

    eng.runner.free = recording_free
    return seen


def _simulate_slots(forwards, max_batch):
    """The continuous-batching schedule from the module docstring: every step admits queued sequences into the
    free slots (lowest first), one forward runs every active row, a row whose last forward it was frees its slot
    for the next step. Returns (slot per sequence, number of forwards)."""
    queue, free, active, slot, steps = list(range(len(forwards))), list(range(max_batch)), {}, {}, 0
    left = list(forwards)
    while queue or active:
        while queue and free:
            i = queue.pop(0)
            slot[i] = free.pop(0)
            active[i] = slot[i]
        steps += 1
        for i in list(active):
            left[i] -= 1
            if left[i] == 0:
                free.append(active.pop(i))
                free.sort()
    return [slot[i] for i in range(len(forwards))], steps


@pytest.mark.parametrize("name", list(CASES))
def test_engine_decodes_every_rule_like_the_reference(name):
    """Tokens, traces, counters, logs and the per-forward events of every sequence equal the plain reference, in
    a batch of 2 slots over 5 sequences of different prompt lengths (aligned or not) and lengths; the slots and
    forward counts follow the continuous-batching schedule."""
    stub, cfg = _stub(name), _cfg(name)
    events = []
    eng, seqs = _run_engine(stub, cfg, PROMPTS, MAX_NEW, 2, on_step=events.append)
    assert eng.run() is eng.sequences and eng.sequences == seqs
    refs = [ref_single(stub, p, m, cfg) for p, m in zip(PROMPTS, MAX_NEW)]
    for i, (s, rs) in enumerate(zip(seqs, refs)):
        assert s.status == FINISHED
        nb = rs.num_blocks
        assert s.canvas == rs.x[:nb * K] and s.trace == rs.trace[:nb * K]
        assert (s.forwards, s.edits, s.mbe_edits, s.deletes, s.inserts) == (
            rs.forwards, rs.edits, rs.mbe_edits, rs.deletes, rs.inserts)
        assert s.edit_log == rs.edit_log and s.lev_drafts == rs.lev_drafts
        mine = [e for e in events if e.seq == i]
        assert [e.forward for e in mine] == list(range(rs.forwards))
        assert [(e.kind, e.block, e.block_done) for e in mine] == rs.events
        assert [e.canvas for e in mine] == [x[:nb * K] for x in rs.snapshots]
        assert [e.finished for e in mine] == [False] * (rs.forwards - 1) + [True]
        assert all(e.prompt_len == len(PROMPTS[i]) for e in mine)
    slots, steps = _simulate_slots([rs.forwards for rs in refs], 2)
    assert [s.slot for s in seqs] == slots
    assert eng.num_forwards == steps and eng.row_forwards == sum(rs.forwards for rs in refs)
    assert sorted(eng.free) == [0, 1] and not eng.active and not eng.queue
    assert eng.step() is False


def test_one_slot_and_many_slots_decode_the_same_tokens():
    """max_batch 1, 3 and 8 (more than the sequences): same tokens and counts; with every sequence admitted at
    once the number of forwards is the longest sequence's."""
    stub, cfg = _stub("mbe-1"), _cfg("mbe-1")
    runs = {}
    for mb in (1, 3, 8):
        eng, seqs = _run_engine(stub, cfg, PROMPTS, MAX_NEW, mb)
        eng.run()
        runs[mb] = [(s.canvas, s.trace, s.forwards, s.edit_log) for s in seqs]
        if mb == 8:
            assert eng.num_forwards == max(s.forwards for s in seqs)
            assert eng.max_batch == 8 and eng.free == list(range(8))
        if mb == 1:
            assert eng.num_forwards == sum(s.forwards for s in seqs) == eng.row_forwards
    assert runs[1] == runs[3] == runs[8]


def test_sequences_submitted_while_others_run_join_at_the_next_forward():
    """New work submitted into a running engine is admitted into a free slot at the next step and decodes
    exactly as alone; a full engine queues it until a slot frees."""
    stub, cfg = _stub("quality"), _cfg("quality")
    eng, seqs = _run_engine(stub, cfg, PROMPTS[:2], [12, 12], 3)
    eng.step()
    eng.step()
    late = eng.submit(PROMPTS[2], max_new_tokens=7)
    assert late.status == QUEUED and late.slot is None
    eng.step()
    assert late.slot == 2 and late.status == DECODING and late.forwards == 1
    late2 = eng.submit(PROMPTS[3], max_new_tokens=6)
    eng.step()
    assert late2.status == QUEUED and late2 in eng.queue
    eng.run()
    for s, p, m in [(seqs[0], PROMPTS[0], 12), (seqs[1], PROMPTS[1], 12), (late, PROMPTS[2], 7), (late2, PROMPTS[3], 6)]:
        rs = ref_single(stub, p, m, cfg)
        assert s.canvas == rs.x and s.trace == rs.trace and s.forwards == rs.forwards
    # late2 takes the slot freed first (the lowest of those freed by the same forward)
    ends = sorted((begin + s.forwards, s.slot) for s, begin in ((seqs[0], 0), (seqs[1], 0), (late, 2)))
    assert late2.slot == ends[0][1]


def test_submit_checks_the_canvas_and_the_default_length():
    stub = _stub("quality")
    cfg = _cfg("quality", max_new_tokens=6)
    eng = Engine(stub, cfg, max_batch=1, canvas_len=10)
    assert eng.T == 12 and eng.K == 4 and eng.mask_id == MASK and eng.eos_ids == {EOS}
    s = eng.submit([3] * 6)
    assert s.max_new == 6 and s.prompt == [3] * 6 and s.id == 0
    too_long = "Engine.submit: a prompt of {} tokens does not fit the canvas of 12 positions"
    with pytest.raises(ValueError, match=exact(too_long.format(7))):
        eng.submit([3] * 7)
    s2 = eng.submit([3] * 10, max_new_tokens=2)
    assert s2.id == 1 and s2.max_new == 2
    eng.submit([], max_new_tokens=12)
    with pytest.raises(ValueError, match=exact(too_long.format(1))):
        eng.submit([4], max_new_tokens=12)
    assert [x.id for x in eng.sequences] == [0, 1, 2] and list(eng.queue) == eng.sequences
    assert Engine(stub, cfg.replace(block_size=3), max_batch=0, canvas_len=7).T == 9  # block_size overrides
    assert Engine(stub, cfg, max_batch=0, canvas_len=8).max_batch == 1


def test_eos_ids_and_levenshtein_ids_of_the_model_config():
    cfg = StubModel(K=K).config
    assert eos_ids_of(cfg) == {EOS}
    cfg.eos_token_id = [5, 7]
    assert eos_ids_of(cfg) == {5, 7}
    cfg.eos_token_id = (6,)
    assert eos_ids_of(cfg) == {6}
    cfg.eos_token_id = None
    assert eos_ids_of(cfg) == set()
    no_ids = ("DecodeConfig.tau_delete / tau_insert: the model's config has no delete_token_id / insert_token_id; "
              "Levenshtein editing needs a model trained with them")
    with pytest.raises(ValueError, match=exact(no_ids)):
        Engine(StubModel(K=K), _cfg("lev"), max_batch=1, canvas_len=8)
    assert Engine(StubModel(K=K, lev=True), _cfg("lev"), max_batch=1, canvas_len=8).lev_ids == (10, 11)
    assert Engine(StubModel(K=K, lev=True), _cfg("quality"), max_batch=1, canvas_len=8).lev_ids is None


def test_eos_in_a_later_block_or_past_max_new_tokens():
    """stop_at_eos: the sequence ends after the block whose generated region [P, min(P + max_new, block end))
    first holds EOS; an EOS past max_new_tokens in that block does not count. Many seeds and EOS rates; the
    reference decides."""
    seen = set()
    for seed in range(6):
        stub = StubModel(K=K, seed=seed, eos_rate=0.3)
        for stop in (True, False):
            cfg = DecodeConfig.preset("m2t", max_post_steps=1, stop_at_eos=stop)
            prompts, lens = [[3], [3, 4, 5, 6, 7], [8, 8]], [6, 2, 13]
            eng, seqs = _run_engine(stub, cfg, prompts, lens, 2)
            eng.run()
            for s, p, m in zip(seqs, prompts, lens):
                rs = ref_single(stub, p, m, cfg)
                assert s.canvas == rs.x[:rs.num_blocks * K] and s.forwards == rs.forwards
                seen.add((stop, len(s.canvas) < rs.num_blocks * K or EOS in s.canvas[len(p):len(p) + m]))
                if stop and EOS in rs.x[len(p):len(p) + m]:
                    b = (len(p) + rs.x[len(p):].index(EOS)) // K
                    assert all(t == MASK for t in s.canvas[(b + 1) * K:])
    assert (True, True) in seen and (False, True) in seen


@pytest.mark.parametrize("name", ["quality", "mbe-1", "mbe-high-tau", "no-post-steps", "early-commit-low",
                                  "lev-delete-only-no-edit"])
def test_the_prefix_cache_commits_and_truncates_by_the_rule(name):
    """Each forward of a block runs [committed length, block end): after it the blocks before the active one are
    committed, and the active block too when it ended with a step that wrote nothing (its keys came from its
    final tokens); a block that ended with a write runs again with the next block. An MBE pass runs its window
    and commits nothing; an MBE edit cuts the cache back to the first edited block. Checked through the slices
    the stub is asked to run, against the reference's forwards."""
    stub, cfg = _stub(name), _cfg(name)
    seen = []
    orig = stub.forward

    def spy(input_ids, **kw):
        seen.append((int(kw["position_ids"][0, 0]), input_ids.shape[1]))
        return orig(input_ids, **kw)
    stub.forward = spy
    p, m = [3, 4, 5, 6, 7], 15
    eng, (s,) = _run_engine(stub, cfg, [p], [m], 1)
    released = _cache_lengths_at_release(eng)
    eng.run()
    rs = ref_single(stub, p, m, cfg)
    assert s.canvas == rs.x
    want, committed, prev, changed = [], 0, list(rs.x[:len(p)]) + [MASK] * (len(rs.x) - len(p)), None
    quiet_ends = 0  # blocks that ended with a step that wrote nothing
    for j, ((kind, b, done), snap) in enumerate(zip(rs.events, rs.snapshots)):
        wrote = snap != prev
        if kind == "block":
            want.append((committed, (b + 1) * K - committed))
            committed = b * K + (K if done and not wrote else 0)
            quiet_ends += done and not wrote
        else:
            lo = max(len(p) // K, b - cfg.mbe_window) * K
            want.append((lo, (b + 1) * K - lo))
            first = [i // K for i in range(len(snap)) if snap[i] != prev[i]]
            if first:
                changed = min(first) if changed is None else min(changed, min(first))
            if j + 1 == len(rs.events) or rs.events[j + 1][0] == "block":
                if changed is not None:
                    committed = min(committed, changed * K)
                changed = None
        prev = snap
    assert seen == want
    assert released[s.id] == committed
    assert quiet_ends > 0 or name not in ("early-commit-low", "lev-delete-only-no-edit")


def test_weight_versions_bound_the_mbe_window():
    """A version change at a block boundary (drain, then a new `version`): every block records the version of its
    first forward, and Multi-Block Editing never reaches back into a block of another version."""
    stub = StubModel(K=K, seed=0, eos_rate=0.0)
    cfg = DecodeConfig.preset("quality", max_post_steps=1, mbe_window=3, mbe_tau=0.7)
    p, m = [3, 4], 22
    eng, (s,) = _run_engine(stub, cfg, [p], [m], 1, version=5)
    assert eng.version == 5
    while len(s.block_versions) < 3:
        assert eng.step()
    eng.drain()
    assert s.at_block_boundary and s.status == DECODING
    first_new = s.block
    assert all(v == 5 for v in s.block_versions.values()) and first_new not in s.block_versions
    eng.version = 6
    eng.run()
    assert s.versions_by_block() == [5] * first_new + [6] * (s.block - first_new + 1)
    rs = ref_single(stub, p, m, cfg, version_from=lambda b: 0 if b < first_new else first_new)
    assert s.canvas == rs.x and s.edit_log == rs.edit_log and s.mbe_edits == rs.mbe_edits > 0
    plain = ref_single(stub, p, m, cfg)
    assert plain.x != rs.x or plain.edit_log != rs.edit_log  # the boundary mattered here


@pytest.mark.parametrize("name", ["mbe-1", "speed-early-commit", "lev"])
def test_drain_export_adopt_continues_in_another_engine(name):
    """Drain stops every row at a block boundary (no admission meanwhile), export hands over the active ones
    (canvas, trace copied) and the queued ones, adopt continues them elsewhere, in slots a finished sequence used
    before (its cache rows and block counters start afresh): the tokens are those of an uninterrupted decode."""
    stub, cfg = _stub(name), _cfg(name)
    prompts, lens = PROMPTS[:4], [9, 9, 9, 9]
    eng, seqs = _run_engine(stub, cfg, prompts, lens, 2)
    for _ in range(5):
        eng.step()
    eng.drain()
    assert not eng.holding and len(eng.queue) == 2
    assert all(s.at_block_boundary for s in eng.active)
    out = eng.export()
    assert out == seqs and not eng.active and not eng.queue and eng.free == [0, 1]
    assert all(s.slot is None for s in out)
    assert [len(s.canvas) for s in out[:2]] == [eng.T, eng.T] and out[2].status == QUEUED
    other = Engine(stub, cfg, max_batch=3, canvas_len=eng.T)
    first = other.submit([9, 9, 9, 9, 9], max_new_tokens=11)
    released = _cache_lengths_at_release(other)
    other.run()
    assert released[first.id] > 0 and first.slot == 0 and first.status == FINISHED
    with pytest.raises(ValueError, match=exact("Engine.adopt: sequence 0 is not at a block boundary (status decoding)")):
        Engine(stub, cfg, max_batch=1, canvas_len=eng.T).adopt(Sequence_at_mid_block(out[0]))
    for s in out:
        other.adopt(s)
    assert [s.id for s in out] == [1, 2, 3, 4] and len(other.queue) == 2
    assert other.run() == [first] + out
    for s, p, m in zip(out, prompts, lens):
        rs = ref_single(stub, p, m, cfg)
        assert s.canvas == rs.x and s.trace == rs.trace and s.forwards == rs.forwards and s.edit_log == rs.edit_log


def Sequence_at_mid_block(s):
    import copy
    bad = copy.copy(s)
    bad.block_versions = {**s.block_versions, s.block: 0}
    return bad


def test_adopt_refuses_what_does_not_fit():
    stub, cfg = StubModel(K=K, eos_rate=0.0), _cfg("quality")
    eng, seqs = _run_engine(stub, cfg, [[3, 4, 5], [6]], [13, 13], 2)
    eng.run_until(lambda: seqs[0].block >= 3)
    eng.drain()
    out = eng.export()
    small = Engine(stub, cfg, max_batch=1, canvas_len=8)
    assert out[0].canvas[8:] != [MASK] * (len(out[0].canvas) - 8)
    with pytest.raises(ValueError, match=exact("Engine.adopt: sequence 0 holds 16 positions, the canvas 8")):
        small.adopt(out[0])
    assert small.sequences == [] and small.run() == []  # a refused sequence is not the engine's
    fresh = Engine(stub, cfg, max_batch=1, canvas_len=16)
    fresh.adopt(out[1])
    with pytest.raises(ValueError, match=exact("Engine.adopt: no free slot (adopt before submitting new sequences)")):
        fresh.adopt(out[0])
    assert fresh.sequences == [out[1]] and out[1].id == 0
    assert fresh.run() == [out[1]]  # the refused out[0] is not decoded or returned
    # a canvas longer than this engine's, masks only past it, fits
    short = Engine(stub, cfg, max_batch=1, canvas_len=16)
    s = out[0]
    s.canvas = s.canvas + [MASK] * 4
    s.trace = s.trace + [-1] * 4
    short.adopt(s)
    assert short.runner.slots.canvas[0].tolist() == s.canvas[:16]
