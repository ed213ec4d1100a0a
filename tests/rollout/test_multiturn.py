"""Multi-turn rollouts: every turn is what the single-turn decoder gives on the context so far; observations are
tokenised alone and start a new block; a failing, hanging or garbage-returning environment fails only its own
trajectory.

Multi-turn rollouts (`rollout.multiturn` on the engine, with `rollout.static_slots` for the compiled step) against
the plain-Python loop of their documented rules (`reference_multiturn` in tests/support/stub_lm.py), on the stub
model: milliseconds per rollout.

The rules: a turn is whole blocks and ends at the block holding EOS, a closed </tool_call> (stop_at_tool_call) or
its last budget block (round_up(start + max_turn_tokens, K), the total budget and the canvas); the turn's text goes
to `env.step`; the observation (wrapped in the template, tokenised alone) starts right after the turn's last block
and the next turn right after it; limits max_turns, max_total_tokens (an observation that does not fit is a named
stop), environment failures and timeouts end only their trajectory."""
import threading
import time

import pytest
import torch

import rollout.compiled as compiled
from ebpo.core.turns import OBSERVATION_TEMPLATE, leaking_blocks, round_up
from ebpo.infra.data import encode_prompt
from ebpo.model.loading import load_model, load_model_tokenizer
from rollout.config import DecodeConfig
from rollout.decoder import generate
from rollout.multiturn import MultiTurnConfig, generate_multiturn, run_episodes, start_episodes, trajectory_of
from rollout.sequence import Sequence
from rollout.trajectory import TurnRecord, summarize
from tests.support.stub_lm import EOS, K, Rule, ScriptEnv, StubLM, StubTokenizer, env_answer, reference_multiturn


QUESTIONS = ["Compute 12+7.", "Compute 45-3.", "Write f(x): add 2 to x."]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")


class Scripted:
    """Answers every turn with `obs<k>`; done after `n` turns. `mode` breaks it: raise | hang | garbage."""

    def __init__(self, n, mode=None, latency=0.0):
        self.n, self.mode, self.latency, self.k = n, mode, latency, 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        time.sleep(self.latency)
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "garbage":
            return 42
        return (f"obs{self.k}", 0.25, self.k >= self.n, {"tool_calls": [{"name": "t", "ok": True, "latency_s": 0.0}]})


def run(tiny, envs, **mt):
    model, tok = tiny
    prompts = [encode_prompt(tok, q) for q in QUESTIONS[:len(envs)]]
    cfg = DecodeConfig.preset("quality", mbe_window=0)
    return prompts, generate_multiturn(model, prompts, envs, cfg, MultiTurnConfig(max_turn_tokens=24, **mt),
                                       tokenizer=tok)


def test_each_turn_is_the_single_turn_decode_of_its_context(tiny):
    model, tok = tiny
    prompts, trajs = run(tiny, [Scripted(1), Scripted(2), Scripted(3)], stop_at_tool_call=False)
    cfg = DecodeConfig.preset("quality", mbe_window=0, max_new_tokens=24)
    K = model.config.block_size
    for p, tr in zip(prompts, trajs):
        assert tr.ids[:len(p)] == p and tr.stop == "done" and not tr.failed
        for turn in tr.turns:
            ref = generate(model, [tr.ids[:turn.start]], cfg)[0]
            assert tr.ids[turn.start:turn.end] == ref.token_ids + ref.tail_ids
            assert turn.end % K == 0 and all(tr.generated[turn.start:turn.end])
            if turn.observation is not None:  # the observation: its own tokens, context, at a block boundary
                obs = tok(OBSERVATION_TEMPLATE.format(observation=turn.observation), add_special_tokens=False)["input_ids"]
                assert turn.obs_start == turn.end and tr.ids[turn.obs_start:turn.obs_end] == obs
                assert not any(tr.generated[turn.obs_start:turn.obs_end])
        assert not any(tr.generated[:len(p)])
        gen, seg = torch.tensor([tr.generated]), torch.tensor([tr.segment])
        assert not leaking_blocks(gen, seg, K).any()
    assert [len(t.turns) for t in trajs] == [1, 2, 3]
    assert trajs[2].env_reward == pytest.approx(0.75)


def test_waiting_sequences_do_not_change_anything_but_time(tiny):
    _, a = run(tiny, [Scripted(2, latency=0.2), Scripted(3), Scripted(1)], continue_ready=True)
    _, b = run(tiny, [Scripted(2, latency=0.2), Scripted(3), Scripted(1)], continue_ready=False)
    assert [t.ids for t in a] == [t.ids for t in b]
    assert [t.generated for t in a] == [t.generated for t in b]


@pytest.mark.parametrize("mode,stop", [("raise", "env_error"), ("hang", "env_timeout"), ("garbage", "env_error")])
def test_a_broken_environment_fails_only_its_trajectory(tiny, mode, stop):
    t0 = time.monotonic()
    _, trajs = run(tiny, [Scripted(2), Scripted(2, mode=mode), Scripted(3)], step_timeout_s=1.0)
    assert time.monotonic() - t0 < 25, "a hung environment must not hold the batch"
    assert trajs[1].failed and trajs[1].stop == stop and trajs[1].turns[-1].error
    assert not trajs[0].failed and not trajs[2].failed and len(trajs[2].turns) == 3
    m = summarize(trajs)
    assert m["agent/failed_count"] == 1 and m[f"agent/stop/{stop}"] == 1


def test_limits_end_trajectories(tiny):
    _, trajs = run(tiny, [Scripted(10), Scripted(10)], max_turns=2)
    assert all(t.stop == "max_turns" and len(t.turns) == 2 for t in trajs)
    _, trajs = run(tiny, [Scripted(10)], max_total_tokens=90)
    assert trajs[0].stop == "max_total_tokens" and len(trajs[0].ids) <= 96


SHORT = "<o>{observation}</o>"


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    """The compiled step's fixed-shape function, run eagerly (same tokens; no compile time)."""
    monkeypatch.setattr(compiled, "COMPILE", False)


def _prompt(i, n):
    return [(5 * i + 3 * j + 1) % 30 for j in range(n)]


# (decode options, MultiTurnConfig options, rule, [(prompt length, env n, observation words)], max_batch)
SCENARIOS = [
    (dict(), dict(max_turns=3, max_turn_tokens=9), Rule(eos=8, tool=10),
     [(3, 3, (5, 9)), (10, 2, (6,)), (13, 5, (7, 4))], None),
    (dict(use_cache=False), dict(max_turns=4, max_turn_tokens=K), Rule(eos=4, tool=6),
     [(9, 4, (1, 8)), (2, 9, (3,))], 1),
    (dict(compiled_step=True), dict(max_turns=3, max_turn_tokens=9), Rule(eos=8, tool=10),
     [(12, 3, (5, 9)), (10, 2, (6,)), (13, 5, (7, 4))], 2),
    ("m2t", dict(max_turns=3, max_turn_tokens=2 * K + 3, max_total_tokens=96), Rule(eos=6, tool=8),
     [(12, 3, (5, 9)), (10, 2, (6,)), (13, 5, (7, 4)), (1, 3, (2,))], 0),
    (dict(preset="m2t", compiled_step=True), dict(max_turns=4, max_turn_tokens=K + 1, max_total_tokens=96),
     Rule(eos=5, tool=9, c=4), [(12, 4, (5, 9)), (11, 3, (6, 3)), (9, 5, (10,))], 2),
    (dict(), dict(max_turns=4, max_turn_tokens=1, stop_at_tool_call=False), Rule(eos=3, tool=30, c=2),
     [(5, 4, (2,)), (8, 4, (1, 5))], 1),
    (dict(), dict(max_turns=4, max_turn_tokens=K - 1, max_total_tokens=41), Rule(eos=2, tool=0, c=3),
     [(6, 9, (3,)), (11, 9, (14,)), (7, 9, (30,)), (40, 2, (1,)), (44, 2, (1,))], 0),
    (dict(compiled_step=True), dict(max_turns=9, max_turn_tokens=7, max_total_tokens=50, observation_template=None),
     Rule(eos=3, tool=5, c=5), [(9, 9, (2,)), (3, 9, (1, 6))], 0),
    (dict(use_cache=False), dict(max_turns=2, max_turn_tokens=30, max_total_tokens=22), Rule(eos=0, tool=0),
     [(5, 3, (1,)), (13, 3, (1,))], 1),
]


def _run(case):
    dec, mt_kw, rule, seqs, max_batch = SCENARIOS[case]
    dec = dict(preset=dec) if isinstance(dec, str) else dict(dec)
    cfg = DecodeConfig.preset(dec.pop("preset", "quality"), **dec)
    mt_kw = dict(mt_kw)
    if mt_kw.get("observation_template", SHORT) is None:
        del mt_kw["observation_template"]  # the default template
    else:
        mt_kw["observation_template"] = SHORT
    mt = MultiTurnConfig(**{"max_total_tokens": 80, **mt_kw})
    prompts = [_prompt(i, n) for i, (n, _, _) in enumerate(seqs)]
    envs = [ScriptEnv(n, obs=obs) for _, n, obs in seqs]
    model = StubLM(rule)
    turns_seen = []
    trajs = generate_multiturn(model, prompts, envs, cfg, mt, tokenizer=StubTokenizer(), max_batch=max_batch,
                               on_turn=lambda i, t: turns_seen.append((i, t.index)))
    T = round_up(max(mt.max_total_tokens, max(map(len, prompts)) + K), K)
    refs = [reference_multiturn(p, ScriptEnv(e.n, obs=e.obs), rule, mt, T) for p, e in zip(prompts, envs)]
    return cfg, mt, prompts, envs, trajs, refs, turns_seen


@pytest.mark.parametrize("case", range(len(SCENARIOS)))
def test_trajectories_equal_the_plain_reference(case):
    """ids, generated, segment, turns (start, end, why, text), stop, the texts each environment saw, rewards,
    observations and their positions, forwards (one per block with m2t, two with editing on) and failures."""
    cfg, mt, prompts, envs, trajs, refs, turns_seen = _run(case)
    fpb = 2 if cfg.editing else 1
    for i, (p, env, tr, ref) in enumerate(zip(prompts, envs, trajs, refs)):
        got = dict(ids=tr.ids, generated=tr.generated, segment=tr.segment,
                   turns=[(t.start, t.end, t.finished_by, t.text) for t in tr.turns], stop=tr.stop, texts=env.texts)
        assert got == ref, (i, got, ref)
        assert tr.prompt_ids == p and not tr.failed and tr.error is None or tr.stop == "observation_overflow"
        assert tr.num_forwards == fpb * sum(-(-(t.end - t.start // K * K) // K) for t in tr.turns)
        assert tr.num_edits == tr.num_deletes == tr.num_inserts == 0 and tr.lev_drafts == []
        assert tr.env_reward == pytest.approx(sum(env.reward * k for k in range(1, len(tr.turns) + 1)))
        assert 0 < tr.wall_s < 30
        for k, t in enumerate(tr.turns):
            obs, reward, done = env_answer(env, k + 1)
            assert (t.index, t.reward, t.done, t.forwards) == (k, reward, done, fpb * -(-(t.end - t.start // K * K) // K))
            appended = k + 1 < len(tr.turns)
            if appended:
                assert (t.observation, t.obs_start, t.obs_end) == (obs, t.end, tr.turns[k + 1].start)
            elif tr.stop == "observation_overflow":
                assert t.observation == obs and str(len(StubTokenizer()(mt.observation_template.format(
                    observation=obs), add_special_tokens=False)["input_ids"])) in tr.error
            else:
                assert (t.obs_start, t.obs_end) == (0, 0)
        assert sorted(k for j, k in turns_seen if j == i) == list(range(len(tr.turns)))


def test_the_scenarios_reach_every_documented_end():
    """The reference over the scenarios above takes every turn end and every stop (the comparison is not
    vacuous)."""
    whys, stops = set(), set()
    for case in range(len(SCENARIOS)):
        _, mt_kw, rule, seqs, _ = SCENARIOS[case]
        mt = MultiTurnConfig(**{"max_total_tokens": 80, **mt_kw, "observation_template": SHORT})
        prompts = [_prompt(i, n) for i, (n, _, _) in enumerate(seqs)]
        T = round_up(max(mt.max_total_tokens, max(map(len, prompts)) + K), K)
        for p, (_, n, obs) in zip(prompts, seqs):
            ref = reference_multiturn(p, ScriptEnv(n, obs=obs), rule, mt, T)
            stops.add(ref["stop"])
            whys |= {t[2] for t in ref["turns"]}
    assert whys == {"eos", "tool_call", "budget"}
    assert stops == {"done", "max_turns", "max_total_tokens", "observation_overflow"}


def _one(env, mt_kw, rule=None, cfg=None, prompt_len=6):
    mt = MultiTurnConfig(**{"observation_template": SHORT, "max_total_tokens": 80, **mt_kw})
    return generate_multiturn(StubLM(rule or Rule(eos=5, tool=5)), [_prompt(0, prompt_len)], [env],
                              cfg or DecodeConfig.preset("quality"), mt, tokenizer=StubTokenizer())[0]


@pytest.mark.parametrize("at", [1, 2, 3])
@pytest.mark.parametrize("how", ["raise", "garbage"])
def test_an_environment_failure_ends_its_trajectory_as_failed_at_that_turn(at, how):
    env = ScriptEnv(9, obs=(2,), fail_at=at if how == "raise" else None, bad_at=at if how == "garbage" else None)
    tr = _one(env, dict(max_turns=9))
    assert tr.stop == "env_error" and tr.failed and len(tr.turns) == at == len(env.texts)
    assert tr.error == tr.turns[-1].error and ("tool broke" in tr.error if how == "raise" else "ValueError" in tr.error)
    assert tr.turns[-1].observation is None and len(tr.ids) == tr.turns[-1].end


def test_the_step_timeout_counts_from_that_steps_submission():
    """Steps of 0.12 s each, a timeout of 0.3 s: the first three answer in time although together they took
    longer than the timeout; the fourth hangs and fails the trajectory about 0.3 s after its submission."""
    env = ScriptEnv(9, obs=(1,), latency={1: 0.12, 2: 0.12, 3: 0.12, 4: 3.0})
    t0 = time.monotonic()
    tr = _one(env, dict(max_turns=9, step_timeout_s=0.3))
    took = time.monotonic() - t0
    assert tr.stop == "env_timeout" and tr.failed and len(tr.turns) == 4 and len(env.texts) == 4
    assert "timed out after 0.3 s" in tr.error and tr.turns[-1].env_latency_s >= 0.3
    # noticed at the engine's next poll (every 0.05 s while every row waits), not a second later; the 0.5 s
    # slack is for a loaded machine's scheduling
    assert tr.turns[-1].env_latency_s < 0.3 + 0.5
    assert took >= 0.36 + 0.3 and took < 2.5  # the hung step (3 s) is abandoned, not waited for


def test_max_turns_allows_exactly_that_many_turns():
    for n in (1, 2, 4):
        env = ScriptEnv(99, obs=(1,))
        tr = _one(env, dict(max_turns=n))
        assert len(tr.turns) == n == len(env.texts) and tr.stop == "max_turns" and not tr.failed


def _calls_during_steps(continue_ready):
    """Runs a slow environment (0.2 s per step) beside a fast one; returns the model calls made while the slow
    one's first step ran, and the fast trajectory."""
    marks = []

    class Slow(ScriptEnv):
        def step(self, text):
            marks.append(model.calls)
            out = super().step(text)
            marks.append(model.calls)
            return out

    model = StubLM(Rule(eos=0, tool=0))
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=K, max_total_tokens=80, observation_template=SHORT,
                         continue_ready=continue_ready)
    fast = ScriptEnv(3, obs=(1,))
    trajs = generate_multiturn(model, [_prompt(0, 5), _prompt(1, 5)], [Slow(2, obs=(1,), latency=0.2), fast],
                               DecodeConfig.preset("quality"), mt, tokenizer=StubTokenizer())
    return marks[1] - marks[0], trajs[1]


def test_ready_sequences_keep_decoding_while_one_waits():
    during, fast = _calls_during_steps(True)
    assert during >= 4 and fast.stop == "done" and len(fast.turns) == 3  # the fast one's later turns ran


def test_without_continue_ready_the_batch_pauses_while_one_waits():
    during, fast = _calls_during_steps(False)
    assert during == 0 and fast.stop == "done"


# ---------------------------------------------------------------------------------------------------- config
LIMITS = "multiturn: max_turns, max_turn_tokens and max_total_tokens must be >= 1"


TEMPLATE = "multiturn.observation_template must contain {observation}"


@pytest.mark.parametrize("bad, message", [(dict(max_turns=0), LIMITS), (dict(max_turn_tokens=0), LIMITS),
                                          (dict(max_total_tokens=-3), LIMITS),
                                          (dict(observation_template="<o></o>"), TEMPLATE)])
def test_validate_refuses_each_bad_limit_naming_it(bad, message):
    with pytest.raises(ValueError) as err:
        MultiTurnConfig(**bad).validate()
    assert str(err.value) == message
    with pytest.raises(ValueError):
        generate_multiturn(StubLM(), [[1]], [ScriptEnv()], None, MultiTurnConfig(**bad), tokenizer=StubTokenizer())


def test_validate_accepts_the_smallest_limits():
    MultiTurnConfig(max_turns=1, max_turn_tokens=1, max_total_tokens=1, observation_template="{observation}").validate()


# ------------------------------------------------------------------------------------------------ trajectory_of
def test_trajectory_of_copies_every_field_of_the_sequence():
    """trajectory_of against the documented record: ids / generated / segment cut to the length, stop "done"
    when none was set, rewards summed, counters copied, wall time from t0 to the end (now when unfinished),
    L-EBPO drafts in block order at their offset from the prompt's end."""
    turns = [TurnRecord(0, 5, 8, "a", "eos", reward=0.5), TurnRecord(1, 11, 16, "b", "budget", reward=2.0)]
    s = Sequence(id=3, prompt=[1, 2, 3, 4, 5], canvas=list(range(20)), generated=[True] * 9 + [False] * 11,
                 segment=list(range(20)), turns=turns, stop="", failed=True, error="x", forwards=7, end_time=12.5,
                 edits=2, deletes=3, inserts=4, lev_drafts={3: [9, 9], 1: [8]}, length=16)
    tr = trajectory_of(s, 10.0, 4)
    assert tr.prompt_ids == [1, 2, 3, 4, 5] and tr.prompt_ids is not s.prompt
    assert tr.ids == list(range(16)) and tr.generated == s.generated[:16] and tr.segment == list(range(16))
    assert tr.turns is turns and tr.stop == "done" and tr.failed and tr.error == "x" and tr.env_reward == 2.5
    assert (tr.num_forwards, tr.num_edits, tr.num_deletes, tr.num_inserts) == (7, 2, 3, 4)
    assert tr.wall_s == 2.5 and tr.lev_drafts == [(4 - 5, [8]), (12 - 5, [9, 9])]
    s.stop, s.end_time = "max_turns", 0.0
    t0 = time.monotonic()
    tr = trajectory_of(s, t0 - 1.0, 4)
    assert tr.stop == "max_turns" and 1.0 <= tr.wall_s < 1.0 + (time.monotonic() - t0) + 1e-6


# ------------------------------------------------------------------------------------------- episodes
def test_start_episodes_resets_each_env_with_its_row_and_seed_and_appends_the_first_observation():
    tok = StubTokenizer()
    envs = [ScriptEnv(), ScriptEnv(), ScriptEnv()]
    rows = [{"first": "a b"}, {"first": None}, {"first": ""}]
    out = start_episodes(envs, rows, [[1], [2, 3], [4]], tok, seeds=[7, 8, 9], template=SHORT)
    assert out == [[1] + tok(SHORT.format(observation="a b"), add_special_tokens=False)["input_ids"], [2, 3], [4]]
    assert [(e.row, e.seed) for e in envs] == list(zip(rows, [7, 8, 9]))
    out = start_episodes(envs, rows, [[1], [2, 3], [4]], tok)
    assert out[0] == [1] + tok("<|user|><tool_response>a b</tool_response><|role_end|><|assistant|>",
                                   add_special_tokens=False)["input_ids"]
    assert [e.seed for e in envs] == [None] * 3


def test_run_episodes_resets_decodes_and_closes_every_environment():
    """run_episodes = start_episodes + generate_multiturn (with its config, limits, seeds, max_batch) + close,
    a failing close ignored; the trajectories equal the reference of the started prompts."""
    tok = StubTokenizer()
    rule = Rule(eos=6, tool=8)
    rows = [{"first": "x"}, {"first": None}, {"first": "y z"}]
    prompts = [_prompt(i, n) for i, n in enumerate([5, 9, 2])]
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=6, max_total_tokens=64, observation_template=SHORT)
    cfg = DecodeConfig.preset("m2t")
    made = []

    def factory():
        made.append(ScriptEnv(2, obs=(3,)))
        if len(made) == 2:  # its close fails: ignored
            made[-1].close = lambda: (_ for _ in ()).throw(RuntimeError("close failed"))
        return made[-1]

    trajs = run_episodes(StubLM(rule), prompts, rows, factory, cfg, mt, tokenizer=tok, seeds=[4, 5, 6], max_batch=1)
    starts = [p + (tok(SHORT.format(observation=r["first"]), add_special_tokens=False)["input_ids"] if r["first"] else [])
              for p, r in zip(prompts, rows)]
    for tr, s, env in zip(trajs, starts, made):
        ref = reference_multiturn(s, ScriptEnv(2, obs=(3,)), rule, mt, 64)
        assert tr.ids == ref["ids"] and tr.stop == ref["stop"] and tr.prompt_ids == s and env.texts == ref["texts"]
        assert tr.num_forwards == sum(-(-(t.end - t.start // K * K) // K) for t in tr.turns)  # m2t: 1 per block
    assert [(e.row, e.seed) for e in made] == list(zip(rows, [4, 5, 6]))
    assert [e.closed for e in made] == [1, 0, 1]  # the second's close raised (and was called)


def test_run_episodes_closes_even_when_decoding_fails():
    made = []

    def factory():
        made.append(ScriptEnv())
        return made[-1]

    with pytest.raises(ValueError):
        run_episodes(StubLM(), [[1], [2]], [{}, {}], factory, None, MultiTurnConfig(max_turns=0),
                     tokenizer=StubTokenizer())
    assert [e.closed for e in made] == [1, 1]


def test_run_episodes_default_limits_and_config():
    env = ScriptEnv(99, obs=(1,))
    tr = run_episodes(StubLM(Rule(eos=0, tool=0)), [_prompt(0, 3)], [{}], lambda: env, tokenizer=StubTokenizer())[0]
    default = MultiTurnConfig()
    assert tr.stop == "max_turns" and len(tr.turns) == default.max_turns and env.closed == 1
    assert all(t.end == round_up(t.start + default.max_turn_tokens, K) for t in tr.turns)
    assert tr.turns[0].end == round_up(3 + default.max_turn_tokens, K)
    assert tr.num_forwards == 2 * sum(-(-(t.end - t.start // K * K) // K) for t in tr.turns)  # quality preset
    assert EOS not in tr.ids


def test_static_slots_reuse_a_slot_for_the_next_queued_sequence():
    """max_batch 1 with the compiled step: each sequence takes the slot of the one before (its cache rows
    still hold the previous keys), and still decodes exactly the reference."""
    rule = Rule(eos=4, tool=6, c=3)
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=6, max_total_tokens=64, observation_template=SHORT)
    prompts = [_prompt(i, n) for i, n in enumerate([13, 9, 17])]
    envs = [ScriptEnv(3, obs=(6,)) for _ in prompts]
    trajs = generate_multiturn(StubLM(rule), prompts, envs, DecodeConfig.preset("m2t", compiled_step=True), mt,
                               tokenizer=StubTokenizer(), max_batch=1)
    for p, tr in zip(prompts, trajs):
        assert tr.ids == reference_multiturn(p, ScriptEnv(3, obs=(6,)), rule, mt, 64)["ids"]


def test_run_episodes_survives_a_failing_close():
    closed = []

    class Bad(ScriptEnv):
        def close(self):
            closed.append(self)
            raise RuntimeError("no")

    trajs = run_episodes(StubLM(), [[1], [2]], [{}, {}], lambda: Bad(1), None,
                         MultiTurnConfig(observation_template=SHORT, max_total_tokens=40), tokenizer=StubTokenizer())
    assert len(trajs) == 2 and len(closed) == 2 and threading.active_count() >= 1


def test_run_episodes_passes_seeds_and_max_batch_on():
    """Sampled decoding: run_episodes gives the trajectories generate_multiturn gives with the same seeds on the
    started prompts; max_batch bounds the rows of every forward."""
    rule = Rule(eos=4, tool=6)
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=7, max_total_tokens=64, observation_template=SHORT)
    cfg = DecodeConfig.preset("quality", temperature=1.0)
    prompts = [_prompt(i, n) for i, n in enumerate([5, 9, 2])]
    rows = [{}, {}, {}]
    model = StubLM(rule, margin=3.0)
    got = run_episodes(model, prompts, rows, lambda: ScriptEnv(3, obs=(2,)), cfg, mt, tokenizer=StubTokenizer(),
                       seeds=[11, 12, 13], max_batch=1)
    assert max(e[1] for e in model.log) == 1
    want = generate_multiturn(StubLM(rule, margin=3.0), prompts, [ScriptEnv(3, obs=(2,)) for _ in prompts], cfg, mt,
                              tokenizer=StubTokenizer(), seeds=[11, 12, 13])
    assert [t.ids for t in got] == [t.ids for t in want]
    other = generate_multiturn(StubLM(rule, margin=3.0), prompts, [ScriptEnv(3, obs=(2,)) for _ in prompts], cfg,
                               mt, tokenizer=StubTokenizer(), seeds=[21, 22, 23])
    assert [t.ids for t in other] != [t.ids for t in want]  # the seeds do choose the tokens


def test_run_episodes_takes_environments_without_close():
    class NoClose:
        def reset(self, row, seed=None):
            return None

        def step(self, text):
            return ("o", 1.0, True, {})

    trajs = run_episodes(StubLM(), [[1], [2]], [{}, {}], NoClose, None,
                         MultiTurnConfig(observation_template=SHORT, max_total_tokens=40), tokenizer=StubTokenizer())
    assert [t.stop for t in trajs] == ["done", "done"]
