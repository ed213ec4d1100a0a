"""The rollout engine (`rollout.engine.Engine`) against a plain-Python reference decoder, driven by a stub model
whose logits are a function of what each position attends (tests/rollout/stub_engine_model.py): block by
block draft-and-edit decoding with every documented rule (M2T with its fallback, T2T, post-steps, the forward
cap, early commit, DELETE / INSERT, Multi-Block Editing, EOS, per-row max_new_tokens), continuous batching
(admission into freed slots, the forward counts), the per-forward events, weight versions and the MBE window
they bound, drain / export / adopt, and multi-turn rollouts (turn ends, observations, budgets, env failures,
timeouts, pausing while a sequence waits). Each test runs in well under a second (issue 40's mutation run of
rollout/engine.py)."""
import concurrent.futures
import pickle
import re

import pytest
import torch
from stub_engine_model import (EOS, MASK, StubModel, StubTokenizer, ref_multiturn, ref_output, ref_single)

from rollout import DecodeConfig
from rollout.engine import Engine, eos_ids_of
from rollout.multiturn import MultiTurnConfig
from rollout.sequence import DECODING, FINISHED, QUEUED, WAITING

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


@pytest.mark.parametrize("name", ["quality", "mbe-1", "mbe-high-tau", "no-post-steps"])
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
    eng.run()
    rs = ref_single(stub, p, m, cfg)
    assert s.canvas == rs.x
    want, committed, prev, changed = [], 0, list(rs.x[:len(p)]) + [MASK] * (len(rs.x) - len(p)), None
    for j, ((kind, b, done), snap) in enumerate(zip(rs.events, rs.snapshots)):
        wrote = snap != prev
        if kind == "block":
            want.append((committed, (b + 1) * K - committed))
            committed = b * K + (K if done and not wrote else 0)
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
    assert eng.cache.lengths[0] == committed


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
    other.run()
    assert other.cache.lengths[0] > 0 and first.status == FINISHED
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
    assert short.slots.canvas[0].tolist() == s.canvas[:16]


# ---- multi-turn


class SyncRunner:
    """env.step run at submission (a done Future of (value, 0.0)), or left pending for `pending` turns."""

    def __init__(self, pending=()):
        self.pending, self.futures, self.calls = set(pending), [], 0

    def submit(self, env, text):
        fut = concurrent.futures.Future()
        self.calls += 1
        self.futures.append((fut, env, text))
        if self.calls - 1 in self.pending:
            return fut
        try:
            fut.set_result((env.step(text), 0.0))
        except Exception as e:  # noqa: BLE001
            fut.set_exception(e)
        return fut


class ScriptEnv:
    """Answers from a script: turn k -> (observation, reward, done, info) or an exception to raise."""

    def __init__(self, script):
        self.script, self.k, self.seen = script, 0, []

    def answer(self, k, text):
        a = self.script[min(k, len(self.script) - 1)]
        if isinstance(a, Exception):
            raise a
        return a

    def step(self, text):
        self.seen.append(text)
        self.k += 1
        return self.answer(self.k - 1, text)


def _mt_engine(stub, cfg, mt, prompts, scripts, T, max_batch=2, runner=None, tool=None, **kw):
    tok = StubTokenizer(tool)
    envs = [ScriptEnv(sc) for sc in scripts]
    eng = Engine(stub, cfg, max_batch=max_batch, canvas_len=T, tokenizer=tok, mt=mt, runner=runner or SyncRunner(),
                 **kw)
    seqs = [eng.submit(p, env=e) for p, e in zip(prompts, envs)]
    return eng, seqs, envs, tok


def _check_trajectory(s, ref, env):
    rs = ref["rs"]
    assert s.stop == ref["stop"] and s.failed == ref["failed"] and s.error == ref["error"]
    assert s.length == ref["length"] and s.canvas == rs.x[:ref["length"]] and s.trace == rs.trace[:ref["length"]]
    assert s.generated == ref["generated"] and s.segment == ref["segment"]
    assert (s.forwards, s.edits, s.mbe_edits, s.deletes, s.inserts) == (
        rs.forwards, rs.edits, rs.mbe_edits, rs.deletes, rs.inserts)
    assert s.edit_log == rs.edit_log
    assert len(s.turns) == len(ref["turns"])
    for t, r in zip(s.turns, ref["turns"]):
        assert (t.start, t.end, t.text, t.finished_by, t.forwards) == (
            r["start"], r["end"], r["text"], r["finished_by"], r["forwards"])
        assert (t.obs_start, t.obs_end) == (r.get("obs_start", 0), r.get("obs_end", 0))
        assert t.observation == r.get("observation")
        if "reward" in r:
            assert (t.reward, t.done) == (r["reward"], r["done"])
    assert env.seen == [r["text"] for r in ref["turns"]]
    assert [t.index for t in s.turns] == list(range(len(s.turns)))
    assert s.future is None  # the step's answer was taken (a finished sequence pickles without waiting)
    assert pickle.loads(pickle.dumps(s)).turns == s.turns


MT_CASES = {
    "done-after-3": (dict(max_turns=5), [("bc", 0.5, False, {}), ("d", 1.0, False, {}), (None, 2.0, True, {})]),
    "max-turns": (dict(max_turns=2), [("bcd", 0.0, False, {})]),
    "tool-call": (dict(max_turns=4, stop_at_tool_call=True), [("e", 0.0, False, {})]),
    "budget-total": (dict(max_turns=9, max_total_tokens=30), [("bcdefg", 0.0, False, {})]),
    "overflow": (dict(max_turns=9, max_total_tokens=26), [("bcdefghijklmnopq", 0.0, False, {})]),
    "env-error": (dict(max_turns=4), [("b", 0.0, False, {}), RuntimeError("tool crashed " + "x" * 300)]),
}


@pytest.mark.parametrize("name", list(MT_CASES))
@pytest.mark.parametrize("dec", ["quality", "mbe-1", "lev"])
def test_multiturn_turns_match_the_reference(name, dec):
    """Each turn's blocks, text, end reason and forwards; the observations' positions and segments; the stop
    reason; as the state machine documents. Three trajectories share two slots."""
    mt_kw, script = MT_CASES[name]
    mt = MultiTurnConfig(**{"max_turn_tokens": 9, "stop_at_tool_call": False, "max_total_tokens": 64,
                            "observation_template": "jk{observation}", **mt_kw})
    stub = StubModel(K=K, seed=2, eos_rate=0.1, lev=dec == "lev")
    cfg = _cfg(dec)
    prompts = [[3, 4, 5], [6] * 8, [7, 8, 9, 3, 4]]
    T = 64
    turns_seen, events = [], []
    eng, seqs, envs, tok = _mt_engine(stub, cfg, mt, prompts, [script] * 3, T, tool=7,
                                      on_turn=lambda i, t: turns_seen.append((i, t.index)), on_step=events.append)
    eng.run()
    probe = ScriptEnv(script)
    for s, p, env in zip(seqs, prompts, envs):
        ref = ref_multiturn(stub, p, probe.answer, cfg, mt, tok, T)
        _check_trajectory(s, ref, env)
        assert s.status == FINISHED and s.end_time > 0
        # every forward's event shows the canvas up to the end of the current turn's last block
        mine = [e for e in events if e.seq == s.id]
        # (a trajectory finishes when its environment answers, never inside a forward)
        assert len(mine) == s.forwards and not any(e.finished for e in mine)
        for e, snap in zip(mine, ref["rs"].snapshots):
            assert type(e.canvas) is list and len(e.canvas) % K == 0 and len(e.canvas) >= (e.block + 1) * K
            assert e.canvas == snap[:len(e.canvas)]
    assert sorted(turns_seen) == sorted((i, t.index) for i, s in enumerate(seqs) for t in s.turns
                                        if t.error is None)


def test_multiturn_max_turn_tokens_ends_a_turn_at_its_block():
    """A turn whose token budget is spent ends at the block that holds its last budgeted position, for every
    budget and observation length (so every turn start within a block)."""
    stub = StubModel(K=K, seed=4, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    for budget in (1, 3, 4, 5, 8):
        for obs in ("b", "bc", "bcd"):
            mt = MultiTurnConfig(max_turn_tokens=budget, max_turns=3, stop_at_tool_call=False, max_total_tokens=60,
                                 observation_template="{observation}")
            eng, (s,), (env,), tok = _mt_engine(stub, cfg, mt, [[3, 4, 5]], [[(obs, 0.0, False, {})]], 60, 1)
            eng.run()
            for t in s.turns:
                assert t.finished_by == "budget"
                assert t.end == -(-(t.start + budget) // K) * K
            ref = ref_multiturn(stub, [3, 4, 5], ScriptEnv([(obs, 0.0, False, {})]).answer, cfg, mt, tok, 60)
            _check_trajectory(s, ref, env)


def test_multiturn_prompt_over_the_budget_and_no_room_left():
    """A prompt that already fills max_total_tokens ends at admission ("max_total_tokens", nothing decoded); a
    trajectory whose turns leave no room even for an empty observation ends with "max_total_tokens", one where
    only this observation is too long with "observation_overflow" (its text kept, the reason named)."""
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    mt = MultiTurnConfig(max_turn_tokens=4, max_total_tokens=12, stop_at_tool_call=False,
                         observation_template="jk{observation}")
    eng, seqs, envs, _ = _mt_engine(stub, cfg, mt, [[3] * 12, [3] * 13, [3] * 5, [3] * 2],
                                    [[("b", 0, False, {})], [("b", 0, False, {})], [("b", 0, False, {})],
                                     [("bcdefg", 0, False, {})]], 20, 1)
    eng.run()
    assert [s.stop for s in seqs] == ["max_total_tokens", "max_total_tokens", "max_total_tokens",
                                      "observation_overflow"]
    assert seqs[0].forwards == 0 and seqs[0].canvas == [3] * 12 and seqs[1].canvas == [3] * 13
    assert seqs[2].length == 12 and seqs[2].turns[0].observation is None
    t = seqs[3].turns[0]
    assert t.observation == "bcdefg" and t.end == 8 and (t.obs_start, t.obs_end) == (0, 0)
    assert seqs[3].error == "observation of 8 tokens does not fit: 8 tokens so far, max_total_tokens 12"
    assert not seqs[3].failed and seqs[2].error is None


def test_observation_ids_given_by_the_environment_are_used_as_they_are():
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    mt = MultiTurnConfig(max_turn_tokens=4, max_turns=2, stop_at_tool_call=False, observation_template="jk{observation}")
    info = {"observation_ids": [9, 8, 7], "tool_calls": [{"name": "x"}]}
    eng, (s,), _, _ = _mt_engine(stub, cfg, mt, [[3, 4]], [[("ignored", 0.25, False, info)]], 40, 1)
    eng.run()
    t = s.turns[0]
    assert (t.obs_start, t.obs_end) == (8, 11) and s.canvas[8:11] == [9, 8, 7] and s.segment[8:11] == [2, 2, 2]
    assert "observation_ids" not in t.info and t.tool_calls == [{"name": "x"}] and t.reward == 0.25
    assert s.turns[1].start == 11 and s.stop == "max_turns" and t.wait_s >= 0 and t.env_latency_s == 0.0


def test_env_step_timeout_counts_from_the_submission():
    """A step still pending past step_timeout_s fails its trajectory ("env_timeout", the error naming the limit);
    the other trajectory goes on and finishes."""
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    mt = MultiTurnConfig(max_turn_tokens=4, max_turns=2, stop_at_tool_call=False, step_timeout_s=0.0,
                         observation_template="{observation}")
    eng, seqs, _, _ = _mt_engine(stub, cfg, mt, [[3, 4], [5]], [[("b", 0, False, {})]] * 2, 40,
                                 runner=SyncRunner(pending={0}))
    eng.run()
    a, b = seqs
    assert a.stop == "env_timeout" and a.failed and a.error == "env.step timed out after 0 s"
    assert a.turns[0].error == a.error and a.future is None and a.turns[0].env_latency_s >= 0
    assert b.stop == "max_turns" and not b.failed
    mt2 = MultiTurnConfig(max_turn_tokens=4, max_turns=2, stop_at_tool_call=False, step_timeout_s=60.0,
                          observation_template="{observation}")
    runner = SyncRunner(pending={0})
    eng, seqs, envs, _ = _mt_engine(stub, cfg, mt2, [[3, 4]], [[("b", 0, False, {})]], 40, runner=runner)
    eng.run_until(lambda: seqs[0].status == WAITING)
    for _ in range(3):
        assert eng.step() is True
    assert seqs[0].status == WAITING and seqs[0].turns[0].error is None
    fut, env, text = runner.futures[0]
    fut.set_result((env.step(text), 0.5))
    eng.run()
    assert seqs[0].stop == "max_turns" and seqs[0].turns[0].env_latency_s == 0.5


@pytest.mark.parametrize("continue_ready", [True, False])
def test_ready_sequences_decode_while_one_waits_unless_paused(continue_ready):
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    mt = MultiTurnConfig(max_turn_tokens=4, max_turns=2, stop_at_tool_call=False, continue_ready=continue_ready,
                         observation_template="{observation}")
    runner = SyncRunner(pending={0})
    eng, (a, b), _, _ = _mt_engine(stub, cfg, mt, [[3, 4, 5, 6], [5] * 9], [[("b", 0, False, {})]] * 2, 40,
                                   runner=runner)
    while a.status != WAITING:
        assert eng.step()
    before = b.forwards
    for _ in range(3):
        assert eng.step() is True
    assert (b.forwards > before) == continue_ready
    fut, env, text = runner.futures[0]
    fut.set_result((env.step(text), 0.0))
    eng.run()
    assert a.stop == b.stop == "max_turns"


def test_progress_line(capsys):
    stub, cfg = _stub("quality"), _cfg("quality")
    eng, seqs = _run_engine(stub, cfg, PROMPTS[:2], [4, 4], 2, progress=True)
    eng.run()
    err = capsys.readouterr().err
    assert err.endswith("\n") and "\rdecode: 2/2 sequences done, 1 rows in the last forward" in err
    assert "decode: 0/2 sequences done, 2 rows in the last forward" in err
    eng2, _ = _run_engine(stub, cfg, PROMPTS[:1], [4], 1)
    eng2.run()
    assert capsys.readouterr().err == ""


def test_run_until_stops_when_asked():
    stub, cfg = _stub("quality"), _cfg("quality")
    eng, seqs = _run_engine(stub, cfg, PROMPTS[:3], [9, 9, 9], 3)
    eng.run_until(lambda: seqs[0].forwards >= 2)
    assert seqs[0].forwards == 2 and eng.num_forwards == 2
    eng.run_until(lambda: False)
    assert all(s.status == FINISHED for s in seqs)


def test_the_engine_allocates_its_slots():
    stub, cfg = _stub("quality"), _cfg("quality")
    eng = Engine(stub, cfg, max_batch=3, canvas_len=9)
    assert eng.slots.canvas.shape == (3, 12) and (eng.slots.canvas == MASK).all()
    assert (eng.slots.trace == -1).all() and eng.slots.post_steps.tolist() == [0, 0, 0]
    assert eng.slots.block_iters.tolist() == [0, 0, 0] and eng.slots.canvas.dtype == torch.long
    assert eng.cache.max_len == 12 and eng.cache.batch_size == 3 and eng.free == [0, 1, 2]
    assert eng.static is None and eng.version == 0 and not eng.holding and eng.runner is None
    assert Engine(stub, cfg.replace(use_cache=False), max_batch=1, canvas_len=4).cache is None


# ---- the compiled step's side of the engine, with a recording stand-in


class RecordingStatic:
    """Stands in for `rollout.static_slots.StaticSlots`: records what the engine asks of it (static_slots'
    docstring: `place` on admission, `refill` of [from, to) blocks after an MBE edit or an adopt, `resume` when a
    turn resumes after its observation)."""

    log = []

    def __init__(self, engine):
        RecordingStatic.log.append(("init", engine.max_batch, engine.T))

    def place(self, engine, s):
        RecordingStatic.log.append(("place", s.id, s.slot, s.block, s.start))

    def resume(self, engine, s):
        RecordingStatic.log.append(("resume", s.id, s.start, s.block, engine.slots.canvas[s.slot, :s.start].tolist()))

    def refill(self, engine, s, from_block, to_block=None):
        RecordingStatic.log.append(("refill", s.id, from_block, to_block))


@pytest.fixture
def recording_static(monkeypatch):
    import rollout.static_slots as static_slots

    RecordingStatic.log = []
    monkeypatch.setattr(static_slots, "StaticSlots", RecordingStatic)
    forwarded = []

    def static_forward(engine, ready):  # the eager path then decodes every row (same tokens, by design)
        forwarded.append([s.id for s in ready])
        return ready
    monkeypatch.setattr(static_slots, "static_forward", static_forward)
    return RecordingStatic.log, forwarded


def test_compiled_step_bookkeeping_single_turn(recording_static):
    log, forwarded = recording_static
    stub = StubModel(K=K, seed=0, eos_rate=0.0)
    cfg = _cfg("mbe-1", compiled_step=True)
    prompts, lens = PROMPTS[:3], [9, 9, 9]
    eng, seqs = _run_engine(stub, cfg, prompts, lens, 2)
    assert eng.cache is None and log == [("init", 2, eng.T)]
    eng.run()
    want_refill = {}
    for s, p, m in zip(seqs, prompts, lens):
        rs = ref_single(stub, p, m, cfg)
        assert s.canvas == rs.x and s.forwards == rs.forwards
        # after each MBE window that changed tokens: refill from the first changed block to the block that ended
        prev, changed, out = rs.snapshots[0], None, []
        for j, ((kind, b, _), snap) in enumerate(zip(rs.events, rs.snapshots)):
            if kind == "mbe":
                diff = [i // K for i in range(len(snap)) if snap[i] != prev[i]]
                if diff:
                    changed = min(diff + ([changed] if changed is not None else []))
                if (j + 1 == len(rs.events) or rs.events[j + 1][0] == "block") and changed is not None:
                    out.append(("refill", s.id, changed, b))
                    changed = None
            prev = snap
        want_refill[s.id] = out
    for s, p in zip(seqs, prompts):
        assert [e for e in log if e[0] == "place" and e[1] == s.id] == [("place", s.id, s.slot, len(p) // K, len(p))]
        assert [e for e in log if e[0] == "refill" and e[1] == s.id] == want_refill[s.id]
    assert sum(len(v) for v in want_refill.values()) > 0
    assert len(forwarded) == eng.num_forwards and all(forwarded)


def test_compiled_step_bookkeeping_multiturn_and_adopt(recording_static):
    log, _ = recording_static
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0, compiled_step=True)
    mt = MultiTurnConfig(max_turn_tokens=4, max_turns=3, stop_at_tool_call=False, observation_template="{observation}")
    runner = SyncRunner(pending={1})
    eng, (s,), _, _ = _mt_engine(stub, cfg, mt, [[3, 4, 5]], [[("de", 0, False, {})]], 40, 1, runner=runner)
    eng.run_until(lambda: s.status == WAITING and len(s.turns) == 2)
    resumes = [e for e in log if e[0] == "resume"]
    t = s.turns[0]
    assert resumes == [("resume", 0, t.obs_end, t.obs_end // K, eng.slots.canvas[0, :t.obs_end].tolist())]
    assert eng.slots.canvas[0, t.obs_start:t.obs_end].tolist() == [3, 4]
    out = eng.export()
    assert out == [s] and s.status == WAITING
    other = Engine(stub, cfg, max_batch=2, canvas_len=40, tokenizer=StubTokenizer(), mt=mt, runner=runner)
    log.clear()
    other.adopt(s)
    assert log == [("refill", 0, 0, s.turns[-1].end // K - 1)]
    eng2, (d,) = _run_engine(stub, cfg, [[3, 4, 5]], [12], 1)
    eng2.run_until(lambda: d.block >= 2)
    eng2.drain()
    eng2.export()
    log.clear()
    other.adopt(d)
    assert log == [("refill", 1, 0, None)]


def test_a_waiting_trajectory_adopted_into_a_longer_canvas_goes_on_as_before():
    """A multi-turn sequence exported while its environment step is pending and adopted by an engine with a longer
    canvas: its per-position turn records are padded to that canvas, the step's answer is taken there, and the
    trajectory ends exactly as the reference on that canvas: its observations and turns reach past the first
    engine's canvas (never-written positions keep trace -1)."""
    stub = StubModel(K=K, seed=3, eos_rate=0.0)
    cfg = _cfg("quality")
    mt = MultiTurnConfig(max_turn_tokens=6, max_turns=3, max_total_tokens=48, stop_at_tool_call=False,
                         observation_template="jk{observation}")
    runner = SyncRunner(pending={0})
    script = [("defghdefgh", 0.5, False, {})]
    eng, (s,), (env,), tok = _mt_engine(stub, cfg, mt, [[3, 4, 5]], [script], 40, 1, runner=runner)
    eng.run_until(lambda: s.status == WAITING)
    eng.drain()
    (out,) = eng.export()
    assert out is s and len(s.generated) == 40
    other = Engine(stub, cfg, max_batch=1, canvas_len=48, tokenizer=tok, mt=mt, runner=runner)
    other.adopt(s)
    assert len(s.generated) == len(s.segment) == 48 and s.generated[40:] == [False] * 8 and s.segment[40:] == [-1] * 8
    fut, e, text = runner.futures[0]
    fut.set_result((e.step(text), 0.0))
    other.run()
    ref = ref_multiturn(stub, [3, 4, 5], ScriptEnv(script).answer, cfg, mt, tok, 48)
    _check_trajectory(s, ref, env)
    assert s.stop == "max_turns" and s.turns[1].obs_end > 40 and s.length == 48


def test_generate_sizes_the_compiled_step_s_canvas(recording_static):
    """With compiled_step, generate builds the engine on `rollout.compiled.canvas_length` (whole buckets of blocks,
    the longest prompt plus its length), one slot per prompt; the tokens are the eager ones."""
    from rollout.compiled import canvas_length
    from rollout.decoder import generate

    log, _ = recording_static
    stub = StubModel(K=K, seed=0)
    cfg = _cfg("quality", compiled_step=True, max_new_tokens=6)
    prompts = [[3, 4, 5], [5] * 9, []]
    outs = generate(stub, prompts, cfg, max_new_tokens=[6, 3, 10])
    T = max(canvas_length([len(p)], m, K) for p, m in zip(prompts, [6, 3, 10]))
    assert T > max(-(-(len(p) + m) // K) * K for p, m in zip(prompts, [6, 3, 10]))
    assert log[0] == ("init", 3, T)
    for o, p, m in zip(outs, prompts, [6, 3, 10]):
        assert o.token_ids == ref_output(ref_single(stub, p, m, cfg), m, K)["token_ids"]


def test_the_default_runner_runs_env_steps_in_threads():
    """Without a runner the engine makes its own (`StepRunner`, mt.max_workers threads); the trajectory is the
    same; the clocks (t0, submission, wait and latency) are the engine's monotonic seconds."""
    import time

    stub = StubModel(K=K, seed=3, eos_rate=0.05)
    cfg = _cfg("quality")
    mt = MultiTurnConfig(max_turn_tokens=6, max_turns=3, max_total_tokens=40, stop_at_tool_call=False,
                         observation_template="jk{observation}", max_workers=2)
    script = [("de", 0.5, False, {})]
    before = time.monotonic()
    eng = Engine(stub, cfg, max_batch=2, canvas_len=40, tokenizer=StubTokenizer(), mt=mt)
    assert before <= eng.t0 <= time.monotonic() and eng.runner is not None
    envs = [ScriptEnv(script), ScriptEnv(script)]
    seqs = [eng.submit([3, 4, 5], env=envs[0]), eng.submit([6, 7], env=envs[1])]
    eng.run()
    after = time.monotonic()
    for s, p, env in zip(seqs, ([3, 4, 5], [6, 7]), envs):
        ref = ref_multiturn(stub, p, ScriptEnv(script).answer, cfg, mt, StubTokenizer(), 40)
        _check_trajectory(s, ref, env)
        assert eng.t0 <= s.end_time <= after
        for t in s.turns[:-1]:
            assert 0 <= t.env_latency_s <= t.wait_s <= after - eng.t0
        assert eng.t0 <= s.submitted <= after


def test_failed_steps_record_how_long_they_ran():
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    mt = MultiTurnConfig(max_turn_tokens=4, max_turns=2, stop_at_tool_call=False, observation_template="{observation}")
    eng, (s,), _, _ = _mt_engine(stub, cfg, mt, [[3, 4]], [[ValueError("bad tool")]], 40, 1)
    eng.run()
    assert s.stop == "env_error" and s.failed and s.error == "ValueError: bad tool" == s.turns[0].error
    assert 0 <= s.turns[0].env_latency_s < 60 and s.future is None and s.status == FINISHED
    eng, (s,), _, _ = _mt_engine(stub, cfg, mt.__class__(**{**mt.__dict__, "step_timeout_s": 0.0}), [[3, 4]],
                                 [[("b", 0, False, {})]], 40, 1, runner=SyncRunner(pending={0}))
    eng.run()
    assert s.stop == "env_timeout" and 0 <= s.turns[0].env_latency_s < 60


@pytest.mark.parametrize("budget, stop", [(12, "max_turns"), (11, "observation_overflow"), (10, "max_total_tokens")])
def test_an_observation_must_leave_room_for_one_more_token(budget, stop):
    """After a turn ending at position 8, an observation of 3 tokens (template "jk" + one letter; the bare template
    is 2) is appended only when at least one position stays free for the next turn within max_total_tokens
    (8 + 3 + 1 <= budget); else the trajectory ends, "max_total_tokens" when not even the bare template could have
    fitted (8 + 2 + 1 > budget), "observation_overflow" otherwise. An observation of None is the bare template."""
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = _cfg("quality", max_post_steps=0)
    mt = MultiTurnConfig(max_turn_tokens=4, max_turns=2, max_total_tokens=budget, stop_at_tool_call=False,
                         observation_template="jk{observation}")
    script = [("d", 0.0, False, {})]
    eng, (s,), (env,), tok = _mt_engine(stub, cfg, mt, [[3, 4, 5, 6]], [script], 16, 1)
    eng.run()
    ref = ref_multiturn(stub, [3, 4, 5, 6], ScriptEnv(script).answer, cfg, mt, tok, 16)
    _check_trajectory(s, ref, env)
    assert s.stop == stop and s.turns[0].end == 8
    if stop == "max_turns":
        assert (s.turns[0].obs_start, s.turns[0].obs_end) == (8, 11) and s.turns[1].start == 11
    script = [(None, 0.0, False, {})]
    eng, (s,), (env,), tok = _mt_engine(stub, cfg, mt, [[3, 4, 5, 6]], [script], 16, 1)
    eng.run()
    _check_trajectory(s, ref_multiturn(stub, [3, 4, 5, 6], ScriptEnv(script).answer, cfg, mt, tok, 16), env)
    assert s.stop == ("max_total_tokens" if budget == 10 else "max_turns")
    if budget > 10:
        assert s.turns[0].obs_end == 10 and s.canvas[8:10] == [9, 0]
