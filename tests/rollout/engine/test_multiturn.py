"""The rollout engine's multi-turn rollouts (turn ends, observations, budgets, environment failures, timeouts, pausing
while a sequence waits), its default step runner, and the compiled step's bookkeeping seen through a recording
stand-in, against the plain-Python references of tests/support/stub_engine_model.py (split from test_rules.py, whose
helpers it shares)."""
import concurrent.futures
import pickle

import pytest
import torch

import rollout.runners as runners
import rollout.static_slots as static_slots
from rollout.engine import Engine
from rollout.env_steps import StepRunner
from rollout.multiturn import MultiTurnConfig, TurnDriver
from rollout.runner import EagerRunner
from rollout.sequence import FINISHED, WAITING
from .test_rules import K, PROMPTS, _cfg, _run_engine, _stub
from tests.support.stub_engine_model import MASK, StubModel, StubTokenizer, ref_multiturn, ref_output, ref_single


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
    """A multi-turn client (`TurnDriver`) on a new engine, one trajectory per prompt submitted; returns (the
    driver, the sequences, the environments, the tokenizer)."""
    tok = StubTokenizer(tool)
    envs = [ScriptEnv(sc) for sc in scripts]
    drv = TurnDriver(stub, cfg, max_batch=max_batch, canvas_len=T, tokenizer=tok, mt=mt,
                     env_runner=runner or SyncRunner(), **kw)
    seqs = [drv.submit(p, env=e) for p, e in zip(prompts, envs)]
    return drv, seqs, envs, tok


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
    """A prompt that already fills max_total_tokens ends at submission ("max_total_tokens", nothing decoded); a
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
    slots, cache = eng.runner.slots, eng.runner.cache
    assert slots.canvas.shape == (3, 12) and (slots.canvas == MASK).all()
    assert (slots.trace == -1).all() and slots.post_steps.tolist() == [0, 0, 0]
    assert slots.block_iters.tolist() == [0, 0, 0] and slots.canvas.dtype == torch.long
    assert cache.max_len == 12 and cache.batch_size == 3 and eng.free == [0, 1, 2]
    # the eager runner (no compiled step), and no environment step runner: the engine has no environments
    assert type(eng.runner) is EagerRunner and eng.version == 0 and not eng.holding
    assert not any(isinstance(v, StepRunner) for v in vars(eng).values())
    assert Engine(stub, cfg.replace(use_cache=False), max_batch=1, canvas_len=4).runner.cache is None


# ---- the compiled step's side of the engine, with a recording stand-in


class RecordingStatic(static_slots.CompiledRunner):
    """Stands in for `rollout.static_slots.CompiledRunner` (built as it is): records what the engine asks of it
    (static_slots' docstring: `place` on admission, `refill` of [from, to) blocks after an MBE edit or an adopt,
    through the compiled runner's own `invalidate` and `load`, `resume` when a turn resumes after its observation)
    and decodes every row with the eager forward (same tokens, by design)."""

    log = []
    forwarded = []

    def __init__(self, model, cfg, **kw):
        super().__init__(model, cfg, **kw)
        RecordingStatic.log.append(("init", self.B, self.T))

    def place(self, s, active):
        EagerRunner.place(self, s, active)
        RecordingStatic.log.append(("place", s.id, s.slot, s.block, s.start))

    def resume(self, s, from_block):
        RecordingStatic.log.append(("resume", s.id, s.start, s.block, self.slots.canvas[s.slot, :s.start].tolist()))

    def refill(self, s, from_block, to_block=None):
        RecordingStatic.log.append(("refill", s.id, from_block, to_block))

    def forward(self, ready, events):
        RecordingStatic.forwarded.append([s.id for s in ready])
        return EagerRunner.forward(self, ready, events)


@pytest.fixture
def recording_static(monkeypatch):
    RecordingStatic.log, RecordingStatic.forwarded = [], []
    monkeypatch.setattr(runners, "CompiledRunner", RecordingStatic)  # what `make_runner` builds
    return RecordingStatic.log, RecordingStatic.forwarded


def test_compiled_step_bookkeeping_single_turn(recording_static):
    log, forwarded = recording_static
    stub = StubModel(K=K, seed=0, eos_rate=0.0)
    cfg = _cfg("mbe-1", compiled_step=True)
    prompts, lens = PROMPTS[:3], [9, 9, 9]
    eng, seqs = _run_engine(stub, cfg, prompts, lens, 2)
    assert eng.runner.cache is None and log == [("init", 2, eng.T)]
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
    drv, (s,), _, _ = _mt_engine(stub, cfg, mt, [[3, 4, 5]], [[("de", 0, False, {})]], 40, 1, runner=runner)
    drv.run_until(lambda: s.status == WAITING and len(s.turns) == 2)
    resumes = [e for e in log if e[0] == "resume"]
    t = s.turns[0]
    canvas = drv.engine.runner.slots.canvas
    assert resumes == [("resume", 0, t.obs_end, t.obs_end // K, canvas[0, :t.obs_end].tolist())]
    assert canvas[0, t.obs_start:t.obs_end].tolist() == [3, 4]
    out = drv.engine.export()
    assert out == [s] and s.status == WAITING
    other = TurnDriver(stub, cfg, max_batch=2, canvas_len=40, tokenizer=StubTokenizer(), mt=mt, env_runner=runner)
    log.clear()
    other.adopt(s)
    assert log == [("refill", 0, 0, s.turns[-1].end // K - 1)]
    eng2, (d,) = _run_engine(stub, cfg, [[3, 4, 5]], [12], 1)
    eng2.run_until(lambda: d.block >= 2)
    eng2.drain()
    eng2.export()
    log.clear()
    other.engine.adopt(d)  # a single-turn sequence: the engine's own, not the multi-turn client's
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
    drv, (s,), (env,), tok = _mt_engine(stub, cfg, mt, [[3, 4, 5]], [script], 40, 1, runner=runner)
    drv.run_until(lambda: s.status == WAITING)
    drv.drain()
    (out,) = drv.engine.export()
    assert out is s and len(s.generated) == 40
    other = TurnDriver(stub, cfg, max_batch=1, canvas_len=48, tokenizer=tok, mt=mt, env_runner=runner)
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
    """Without a runner the driver makes its own (`StepRunner`, mt.max_workers threads); the trajectory is the
    same; the clocks (t0, submission, wait and latency) are the engine's monotonic seconds."""
    import time

    stub = StubModel(K=K, seed=3, eos_rate=0.05)
    cfg = _cfg("quality")
    mt = MultiTurnConfig(max_turn_tokens=6, max_turns=3, max_total_tokens=40, stop_at_tool_call=False,
                         observation_template="jk{observation}", max_workers=2)
    script = [("de", 0.5, False, {})]
    before = time.monotonic()
    drv = TurnDriver(stub, cfg, max_batch=2, canvas_len=40, tokenizer=StubTokenizer(), mt=mt)
    eng = drv.engine
    assert before <= eng.t0 <= time.monotonic() and drv.env_runner is not None
    envs = [ScriptEnv(script), ScriptEnv(script)]
    seqs = [drv.submit([3, 4, 5], env=envs[0]), drv.submit([6, 7], env=envs[1])]
    drv.run()
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
