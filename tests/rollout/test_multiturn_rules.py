"""Multi-turn rules that no happy-path test pins, written against the public API only
(`generate_multiturn`, `run_episodes`, `MultiTurnConfig`, the `Trajectory` / `TurnRecord` records), so that they
hold for any engine behind it:

* a turn whose token budget is spent ends at the block holding its last allowed token, not one block later;
* with `continue_ready=True` the ready sequences really keep decoding while another waits on its environment
  (and with `continue_ready=False` they do not);
* an `env.step` timeout counts from that step's submission, not from the start of the batch.
"""
import threading
import time

import pytest

from ebpo.core.turns import round_up
from ebpo.infra.data import encode_prompt
from ebpo.model.loading import load_model, load_model_tokenizer
from rollout.config import DecodeConfig
from rollout.multiturn import MultiTurnConfig, generate_multiturn, run_episodes

QUESTIONS = ["Compute 12+7.", "Compute 45-3.", "Write f(x): add 2 to x.", "What is 3*4?"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")


def _prompts(tok, n):
    return [encode_prompt(tok, q) for q in QUESTIONS[:n]]


def _cfg():
    return DecodeConfig.preset("quality", mbe_window=0)


class Echo:
    """Answers every turn with an observation of `words[k % len]` words; done after `n` turns. `latency` (s)
    per step, or per step index (a dict); `hang_at`: that step (1-based) sleeps `hang_s`."""

    def __init__(self, n, words=(1,), latency=0.0, hang_at=None, hang_s=30.0):
        self.n, self.words, self.latency, self.hang_at, self.hang_s = n, words, latency, hang_at, hang_s
        self.k = 0

    def reset(self, row, seed=None):
        self.k = 0
        return None

    def step(self, text):
        self.k += 1
        lat = self.latency.get(self.k, 0.0) if isinstance(self.latency, dict) else self.latency
        time.sleep(lat)
        if self.k == self.hang_at:
            time.sleep(self.hang_s)
        return (" ".join(["ok"] * self.words[self.k % len(self.words)]), 0.0, self.k >= self.n, {})


# ------------------------------------------------------------------------------------------------ turn budget
@pytest.mark.parametrize("budget_blocks", [(0, 1), (0, -1), (1, 0), (1, 1), (2, 3)])
def test_a_turn_whose_budget_is_spent_ends_at_that_block(tiny, budget_blocks):
    """max_turn_tokens M = a * K + b for several a, b (a budget ending inside a block, on its last token, on a
    boundary): every turn ends on a block boundary no later than round_up(start + M, K), and a turn that ended
    by its budget ends exactly there. Observations of different lengths make turns start at different offsets
    within a block."""
    model, tok = tiny
    K = model.config.block_size
    a, b = budget_blocks
    M = max(1, a * K + b)
    envs = [Echo(3, words=(1, 2, 5)), Echo(3, words=(3,)), Echo(3, words=(2, 7))]
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=M, max_total_tokens=2048, stop_at_tool_call=False)
    trajs = generate_multiturn(model, _prompts(tok, 3), envs, _cfg(), mt, tokenizer=tok)
    budget_turns = 0
    for tr in trajs:
        assert not tr.failed
        for t in tr.turns:
            assert t.end % K == 0 and t.start < t.end <= round_up(t.start + M, K), (M, t.start, t.end)
            assert all(tr.generated[t.start:t.end])
            if t.finished_by == "budget":
                budget_turns += 1
                assert t.end == round_up(t.start + M, K), (M, t.start, t.end)
    assert budget_turns > 0, "no turn ran out of budget: the rule was not exercised"


def test_the_budget_rule_holds_through_run_episodes(tiny):
    model, tok = tiny
    K = model.config.block_size
    M = K + 3
    mt = MultiTurnConfig(max_turns=2, max_turn_tokens=M, max_total_tokens=2048, stop_at_tool_call=False)
    trajs = run_episodes(model, _prompts(tok, 2), [{}, {}], lambda: Echo(2, words=(4,)), _cfg(), mt, tokenizer=tok)
    turns = [t for tr in trajs for t in tr.turns]
    assert turns and all(t.end <= round_up(t.start + M, K) for t in turns)
    assert all(t.end == round_up(t.start + M, K) for t in turns if t.finished_by == "budget")


# ------------------------------------------------------------------------------------------------ continue_ready
class Slow:
    """Its first step waits until `event` is set (another sequence's progress), at most `fallback_s`, and
    records whether it was set then."""

    def __init__(self, event, fallback_s):
        self.event, self.fallback_s, self.saw = event, fallback_s, None

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.saw = self.event.wait(self.fallback_s)
        return ("ok", 0.0, True, {})


class Fast:
    """Done after `n` steps; its n-th step sets `event`."""

    def __init__(self, n, event):
        self.n, self.event, self.k = n, event, 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        if self.k >= self.n:
            self.event.set()
        return ("ok", 0.0, self.k >= self.n, {})


@pytest.mark.parametrize("n_fast", [2, 3])
@pytest.mark.parametrize("slow_first", [True, False])
def test_ready_sequences_keep_decoding_while_one_waits(tiny, n_fast, slow_first):
    """One sequence's first step blocks until the others have finished all their turns: with continue_ready
    they do (their later turns are decoded while it waits), so it is released at once, not at its fallback."""
    model, tok = tiny
    done = threading.Event()
    slow = Slow(done, fallback_s=30.0)
    fast = [Fast(n_fast, threading.Event()) for _ in range(2)]

    def all_fast():  # the event the slow step waits on: every fast sequence finished
        for f in fast:
            f.event.wait()
        done.set()

    threading.Thread(target=all_fast, daemon=True).start()
    envs = [slow] + fast if slow_first else fast + [slow]
    mt = MultiTurnConfig(max_turns=n_fast, max_turn_tokens=8, continue_ready=True, step_timeout_s=60.0,
                         stop_at_tool_call=False)
    t0 = time.monotonic()
    trajs = generate_multiturn(model, _prompts(tok, 3), envs, _cfg(), mt, tokenizer=tok)
    assert slow.saw is True, "the ready sequences did not decode while one waited"
    assert time.monotonic() - t0 < 25
    for env, tr in zip(envs, trajs):
        assert not tr.failed and tr.stop == "done"
        assert len(tr.turns) == (1 if env is slow else n_fast)


def test_without_continue_ready_the_batch_pauses_while_one_waits(tiny):
    """The documented baseline: while one sequence waits, nothing else decodes (its own steps still run)."""
    model, tok = tiny
    done = threading.Event()
    slow, fast = Slow(done, fallback_s=2.0), Fast(2, done)
    mt = MultiTurnConfig(max_turns=2, max_turn_tokens=8, continue_ready=False, step_timeout_s=60.0,
                         stop_at_tool_call=False)
    trajs = generate_multiturn(model, _prompts(tok, 2), [slow, fast], _cfg(), mt, tokenizer=tok)
    assert slow.saw is False  # the other sequence's second turn was not decoded while the first waited
    assert [len(t.turns) for t in trajs] == [1, 2] and not any(t.failed for t in trajs)


# ------------------------------------------------------------------------------------------------ step timeout
@pytest.mark.parametrize("timeout_s,latency_s,turns", [(1.0, 0.4, 5), (1.5, 0.6, 4)])
def test_the_step_timeout_counts_from_that_steps_submission(tiny, timeout_s, latency_s, turns):
    """Every step takes well under step_timeout_s, but the trajectory lasts much longer than it: no step
    times out. A step that hangs late in the batch times out after step_timeout_s from its own submission
    (its recorded latency is at least that), not at once."""
    model, tok = tiny
    assert turns * latency_s > 1.5 * timeout_s
    envs = [Echo(turns, latency=latency_s), Echo(turns, latency=latency_s, hang_at=turns - 1, hang_s=30.0)]
    mt = MultiTurnConfig(max_turns=turns, max_turn_tokens=8, step_timeout_s=timeout_s, stop_at_tool_call=False)
    t0 = time.monotonic()
    ok, hung = generate_multiturn(model, _prompts(tok, 2), envs, _cfg(), mt, tokenizer=tok)
    took = time.monotonic() - t0
    assert not ok.failed and ok.stop == "done" and len(ok.turns) == turns, ok.error
    assert all(t.error is None for t in ok.turns)
    assert ok.wall_s > 1.5 * timeout_s  # the batch outlived the timeout, so a batch-start clock would have fired
    assert hung.failed and hung.stop == "env_timeout" and len(hung.turns) == turns - 1
    last = hung.turns[-1]
    assert last.error and "timed out" in last.error
    # from its submission: it had its whole timeout (it slept latency_s first, then hung)
    assert timeout_s <= last.env_latency_s < timeout_s + 5.0
    assert took < 25, "a hung step must not hold the batch"
