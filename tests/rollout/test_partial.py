"""Partial rollouts (`rollout.partial`) against a plain-Python model of their documented rules, on the stub model
of tests/support/stub_lm.py (milliseconds per call).

The reference `RefPartial` keeps the same state as `PartialRollouts` by hand: sequences at block boundaries
carried across calls, each block decoded whole under the version of the call that started it (the stub's
tokens are the rule applied under that version), slots given first-in-first-out to the lowest free index, a
group complete when its last member finishes, the first `quota` groups to complete returned (in completion
order), then every overdue group (`due_version`) beyond them, groups with an older block than `min_version`
dropped at the start of a call. With editing on (the quality preset) a block takes two forwards, its fill and
its confirming post-step, so a stop in the middle of a block (the drain) is exercised; with m2t it takes one.
"""
import pickle
import random

import pytest

import rollout.compiled as compiled

from rollout.config import DecodeConfig
from rollout.partial import CollectStats, NewSequence, PartialRollouts, close_env, decoded_tokens
from rollout.sequence import Sequence
from tests.support.stub_lm import EOS, K, MASK, Rule, StubLM, ctx_of

RULE = Rule(a=5, b=3, c=1, eos=9, mod=97)


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    """The compiled step's fixed-shape function, run eagerly (same tokens; no compile time)."""
    monkeypatch.setattr(compiled, "COMPILE", False)


class RefSeq:
    def __init__(self, prompt, tag, max_new, rule=RULE):
        self.prompt, self.tag, self.max_new, self.rule = list(prompt), tag, max_new, rule
        P = len(prompt)
        self.nb = -(-(P + max_new) // K)
        self.canvas = self.prompt + [MASK] * (self.nb * K - P)
        self.block, self.phase, self.versions = P // K, 0, {}
        self.status = "queued"  # queued, active, finished

    def oldest(self):
        return min(self.versions.values()) if self.versions else None

    def gen_tokens(self, blocks):
        P = len(self.prompt)
        return sum(P <= i < P + self.max_new for b in blocks for i in range(b * K, (b + 1) * K))

    def forward(self, version, forwards_per_block):
        """One forward of the active block; True when the sequence finished with it."""
        b = self.block
        if self.phase == 0:
            v = self.versions.setdefault(b, version)
            ctx = ctx_of(self.canvas, b)
            for p in range(max(len(self.prompt), b * K), (b + 1) * K):
                self.canvas[p] = self.rule(p, ctx, v)
        self.phase += 1
        if self.phase < forwards_per_block:
            return False
        P = len(self.prompt)
        self.phase = 0
        if EOS in self.canvas[P:min(P + self.max_new, (b + 1) * K)] or b + 1 >= self.nb:
            self.status = "finished"
            return True
        self.block = b + 1
        return False


class RefPartial:
    """The documented rules of PartialRollouts.collect, by hand (module docstring)."""

    def __init__(self, rule=RULE):
        self.sizes, self.carried, self.done, self.rule = {}, [], [], rule

    def collect(self, new, quota, version, max_batch, fpb, max_new, min_version=None, due_version=None):
        stats = dict(dropped=0, dropped_tokens=0, carried_in=0, carried_out=0, forwards=0)
        if min_version is not None:
            stale = {s.tag for s in self.carried + self.done if s.oldest() is not None and s.oldest() < min_version}
            for s in self.carried + self.done:
                if s.tag in stale:
                    stats["dropped"] += 1
                    stats["dropped_tokens"] += s.gen_tokens(s.versions)
            self.carried = [s for s in self.carried if s.tag not in stale]
            self.done = [s for s in self.done if s.tag not in stale]
            for t in stale:
                self.sizes.pop(t, None)
        due = set() if due_version is None else {s.tag for s in self.carried + self.done
                                                 if s.oldest() is not None and s.oldest() < due_version}
        fresh = [RefSeq(p, t, max_new, self.rule) for p, t in new]
        for s in fresh:
            self.sizes[s.tag] = self.sizes.get(s.tag, 0) + 1
        slots = max_batch if max_batch > 0 else max(1, len(self.carried) + len(fresh))
        before = {id(s): set(s.versions) for s in self.carried + self.done}
        stats["carried_in"] = len(self.carried)
        order = sorted(self.carried, key=lambda s: (s.tag not in due, s.status == "queued")) + fresh
        free, active, queue = list(range(slots)), [], []
        for s in order:
            if s.status == "active":
                s.slot = free.pop(0)
                active.append(s)
            else:
                queue.append(s)
        counts, complete, counted = {}, [], set()
        for s in self.done:
            counts[s.tag] = counts.get(s.tag, 0) + 1
        complete = [t for t, n in counts.items() if n == self.sizes.get(t)]
        waiting = due - set(complete)

        def note():
            for s in order:
                if s.status == "finished" and id(s) not in counted:
                    counted.add(id(s))
                    self.done.append(s)
                    counts[s.tag] = counts.get(s.tag, 0) + 1
                    if counts[s.tag] == self.sizes[s.tag]:
                        complete.append(s.tag)
                        waiting.discard(s.tag)
            return len(complete) >= quota and not waiting

        def step(holding):
            if not holding:
                while queue and free:
                    s = queue.pop(0)
                    s.slot, s.status = free.pop(0), "active"
                    active.append(s)
            ready = [s for s in active if not (holding and s.phase == 0)]
            if not ready:
                return False
            stats["forwards"] += 1
            for s in ready:
                if s.forward(version, fpb):
                    active.remove(s)
                    free.append(s.slot)
                    free.sort()
            return True

        while not note() and step(False):
            pass
        note()
        while any(s.phase for s in active):  # drain: finish the blocks begun, start nothing
            step(True)
        note()
        self.carried = list(active) + queue
        stats["carried_out"] = len(self.carried)
        picked = complete[:quota] + [t for t in complete[quota:] if t in due]
        out = []
        for t in picked:
            out += [s for s in self.done if s.tag == t]
            del self.sizes[t]
        self.done = [s for s in self.done if all(s is not o for o in out)]
        stats["returned_tokens"] = sum(s.gen_tokens(s.versions) for s in out)
        stats["carried_tokens"] = sum(s.gen_tokens(before.get(id(s), set())) for s in out)
        return out, stats


def _prompt(i, n):
    return [(7 * i + 3 * j) % 30 for j in range(n)]


def _requests(call, groups, size, lens):
    return [(_prompt(10 * call + g * size + m, lens[(g + m + call) % len(lens)]), (call, g))
            for g in range(groups) for m in range(size)]


def _check(out, stats, ref_out, ref_stats):
    got = [(s.tag, s.canvas[:len(r.canvas)], dict(s.block_versions)) for s, r in zip(out, ref_out)]
    want = [(r.tag, r.canvas, r.versions) for r in ref_out]
    assert len(out) == len(ref_out) and got == want
    for key, v in ref_stats.items():
        assert getattr(stats, key) == v, (key, getattr(stats, key), v)


SCHEDULES = [  # (preset, max_batch, max_new, calls: [(groups, size, quota, min_version, due_version)])
    ("quality", 3, 14, [(3, 2, 1, None, None), (2, 2, 1, None, None), (0, 0, 2, None, None), (0, 0, 9, None, None)]),
    ("quality", 2, 17, [(2, 3, 1, None, None), (2, 1, 1, 0, 1), (1, 2, 1, 1, 2), (0, 0, 5, 2, 3)]),
    ("m2t", 0, 12, [(4, 2, 2, None, None), (2, 2, 1, 1, None), (1, 1, 1, 1, None), (0, 0, 9, None, None)]),
    ("quality", 4, 21, [(3, 3, 1, None, 0), (2, 2, 1, None, 1), (2, 2, 0, None, 2), (0, 0, 1, 1, 3),
                        (0, 0, 9, None, None)]),
    ("m2t", 1, 10, [(2, 2, 1, None, None), (2, 2, 1, None, 1), (0, 0, 1, 1, 2), (0, 0, 9, None, None)]),
    ("quality", 5, 9, [(3, 2, 3, 0, 0), (3, 2, 1, 1, None), (0, 0, 1, 2, None), (0, 0, 9, 3, None)]),
    # overdue groups' queued members are admitted before the others' (and their active ones adopted first)
    ("quality", 2, 12, [(3, 3, 1, None, None), (0, 0, 1, None, 1), (1, 2, 1, None, 2), (0, 0, 99, None, None)]),
    ("m2t", 3, 16, [(2, 2, 0, None, None), (2, 3, 1, None, 1), (0, 0, 1, None, 2), (0, 0, 99, None, None)]),
]


def _random_schedule(seed):
    rng = random.Random(seed)
    calls = []
    for call in range(rng.randint(3, 5)):
        old = [None, None, call - 2, call - 1, call]
        calls.append((rng.randint(0, 3), rng.randint(1, 3), rng.randint(0, 3), rng.choice(old), rng.choice(old)))
    calls.append((0, 0, 99, None, None))
    lens = tuple(rng.sample(range(1, 15), 3))
    return (rng.choice(["quality", "m2t"]), rng.randint(0, 4), rng.randint(5, 20), calls, rng.random() < 0.4,
            rng.choice([0, 3, 9]), lens)


SCHEDULES = [s + (False, 9, (3, 6, 9, 13)) for s in SCHEDULES] + [s[:4] + (True, 9, (3, 6, 9, 13)) for s in SCHEDULES[:2]]
SCHEDULES += [_random_schedule(seed) for seed in range(40)]


@pytest.mark.parametrize("case", range(len(SCHEDULES)))
def test_collect_calls_equal_the_reference(case):
    """A run of calls (new groups, a quota, a version bumped per call, min_version and due_version) returns
    the reference's sequences (tags, tokens, each block's version) and stats, call after call; eager, and with
    the compiled step (its slots refilled when a carried sequence is adopted); the hand-written schedules,
    then random ones."""
    _run_schedule(case, holder=False)


@pytest.mark.parametrize("case", list(range(10)) + list(range(len(SCHEDULES) - 10, len(SCHEDULES))))
def test_sequences_held_in_a_long_lived_engine_between_calls_equal_the_reference(case):
    """The same with one long-lived engine for every call (a rollout worker's `EngineHolder`): carried
    sequences stay held in their slots between calls (`Engine.export(keep_slots=True)`) instead of leaving as
    host state, and everything the reference says still holds."""
    _run_schedule(case, holder=True)


def _run_schedule(case, holder):
    from rollout.engine import resident
    from rollout.engine_holder import EngineHolder

    preset, max_batch, max_new, calls, static, eos, lens = SCHEDULES[case]
    cfg = DecodeConfig.preset(preset, max_new_tokens=max_new, compiled_step=static)
    fpb = 2 if cfg.editing else 1
    rule = Rule(a=5, b=3, c=1 + case, eos=eos, mod=97)
    model, part, ref = StubLM(rule), PartialRollouts(), RefPartial(rule)
    engines = EngineHolder(model) if holder else None
    for call, (groups, size, quota, min_v, due_v) in enumerate(calls):
        model.version = call
        reqs = _requests(call, groups, size, lens)
        new = [NewSequence(p, None, t) for p, t in reqs]
        out, stats = part.collect(model, cfg, new, quota, call, max_batch=max_batch, min_version=min_v,
                                  due_version=due_v, engines=engines)
        if holder:  # the active carried sequences wait in the engine's slots, the queued ones outside
            e = engines.engine
            assert all(resident(e, s) == (s.status != "queued") for s in part.carried)
            assert sum(resident(e, s) for s in part.carried) == len(e.active) <= e.max_batch
        ref_out, ref_stats = ref.collect(reqs, quota, call, max_batch, fpb, max_new, min_v, due_v)
        _check(out, stats, ref_out, ref_stats)
        assert set(part.group_sizes) == set(ref.sizes)
        assert [s.tag for s in part.carried] == [s.tag for s in ref.carried]
        assert [s.tag for s in part.done] == [s.tag for s in ref.done]


def test_every_group_is_returned_exactly_once_whole_and_nothing_older_than_due_stays():
    """Whatever the quotas: every submitted group comes back exactly once, with all its members; after a call
    with due_version d, no carried or finished sequence holds a block older than d; nothing is dropped when
    each call waits for the groups the next call's min_version would drop."""
    cfg = DecodeConfig.preset("quality", max_new_tokens=19)
    model, part = StubLM(RULE), PartialRollouts()
    sizes, seen = {}, []
    for call in range(6):
        model.version = call
        reqs = _requests(call, 3 if call < 4 else 0, 2, (2, 5, 11))
        for _, t in reqs:
            sizes[t] = sizes.get(t, 0) + 1
        out, stats = part.collect(model, cfg, [NewSequence(p, None, t) for p, t in reqs], 1, call, max_batch=2,
                                  min_version=call - 2, due_version=call - 1)
        assert stats.dropped == 0 and not part.dropped_tags
        for t in dict.fromkeys(s.tag for s in out):
            assert sum(s.tag == t for s in out) == sizes[t]
            seen.append(t)
        for s in part.carried + part.done:
            assert s.oldest_version() is None or s.oldest_version() >= call - 1
    out, _ = part.collect(model, cfg, [], 100, 6, max_batch=2)
    seen += list(dict.fromkeys(s.tag for s in out))
    assert sorted(seen) == sorted(sizes) and not part.carried and not part.done and not part.group_sizes


def test_drop_mode_drops_whole_groups_counts_them_and_closes_their_environments():
    """min_version without due_version: the groups holding a block older than it are dropped whole (carried
    and finished members), counted with their generated tokens, their environments closed, never returned."""
    cfg = DecodeConfig.preset("quality", max_new_tokens=20)
    model, part = StubLM(RULE), PartialRollouts()
    envs = {}

    class Closable:
        def __init__(self, fail):
            self.closed, self.fail = 0, fail

        def close(self):
            self.closed += 1
            if self.fail:
                raise OSError("close failed")

    reqs = _requests(0, 5, 2, (5, 6, 7))
    new = []
    for i, (p, t) in enumerate(reqs):
        envs[i] = Closable(i % 2)
        new.append(NewSequence(p, None, t))
    out, _ = part.collect(model, cfg, new, 1, 0, max_batch=3)
    held = part.carried + part.done
    stale = {s.tag for s in held if s.oldest_version() is not None}
    gone = [s for s in held if s.tag in stale]
    kept = [s for s in held if s.tag not in stale]
    assert len(gone) >= 3 and any(s.oldest_version() is None for s in gone)  # a queued member goes with its group
    tokens = sum(decoded_tokens(s, K)[0] for s in gone)
    for i, s in enumerate(gone):
        s.env = envs[i]  # single-turn sequences: the env is only there to be closed
    model.version = 1
    out, stats = part.collect(model, cfg, [], 0, 1, max_batch=3, min_version=1)
    assert out == [] and part.dropped_tags == stale and stats.dropped == len(gone)
    assert stats.dropped_tokens == tokens > 0
    assert all(envs[i].closed == 1 for i in range(len(gone)))
    assert set(part.group_sizes) == {s.tag for s in kept} and stats.carried_in == len(kept)
    assert all(s.tag not in stale for s in part.carried + part.done)
    out, stats = part.collect(model, cfg, [], 5, 2, max_batch=3, min_version=2)
    assert part.dropped_tags == set() and stats.dropped == 0
    part.dropped_tags = {"x"}
    part.collect(model, cfg, [], 5, 3, max_batch=3)
    assert part.dropped_tags == set()  # each call says what it dropped, nothing without min_version


def test_a_zero_max_batch_decodes_everything_at_once_and_the_canvas_fits_the_longest():
    """max_batch 0: one slot per sequence (carried and new), so with quota = every group one call returns all
    of them after as many forwards as the longest needs; the canvas holds the longest prompt + max_new."""
    cfg = DecodeConfig.preset("m2t", max_new_tokens=6, stop_at_eos=False)
    model, part = StubLM(RULE), PartialRollouts()
    reqs = [(_prompt(i, n), i) for i, n in enumerate([1, 22, 5])]
    out, stats = part.collect(model, cfg, [NewSequence(p, None, t) for p, t in reqs], 3, 0, max_batch=0)
    assert [s.tag for s in sorted(out, key=lambda s: s.tag)] == [0, 1, 2]
    longest = max(-(-(len(p) + 6) // K) - len(p) // K for p, _ in reqs)
    assert stats.forwards == longest and stats.returned_tokens == 18 and stats.carried_tokens == 0


def test_members_come_back_in_the_order_they_finished():
    """The docstring: a returned group's members are in the order they finished (readers group samples by tag,
    so nothing depends on submission order)."""
    cfg = DecodeConfig.preset("quality", max_new_tokens=16, stop_at_eos=False)
    model, part = StubLM(RULE), PartialRollouts()
    new = [NewSequence(_prompt(0, 3), None, "g"), NewSequence(_prompt(1, 4), None, "g")]  # 5 blocks, then 4
    out, _ = part.collect(model, cfg, new, 1, 0, max_batch=2)
    assert [s.prompt for s in out] == [new[1].prompt, new[0].prompt]


def test_decoded_tokens_counts_generated_positions_of_the_decoded_blocks():
    """decoded_tokens against a plain count: single-turn, the positions of [prompt_len, prompt_len + max_new)
    in the decoded blocks; multi-turn, the positions marked generated; `old` those of `old_blocks`."""
    for P, max_new, blocks, old in [(3, 9, [0, 1, 2], {1}), (4, 5, [1, 2], {2}), (6, 2, [1], set()), (0, 8, [0, 1], {0, 1})]:
        s = Sequence(id=0, prompt=list(range(P)), max_new=max_new, block_versions={b: 0 for b in blocks})
        n = sum(P <= i < P + max_new for b in blocks for i in range(b * K, (b + 1) * K))
        o = sum(P <= i < P + max_new for b in blocks if b in old for i in range(b * K, (b + 1) * K))
        assert decoded_tokens(s, K, old) == (n, o)
        assert decoded_tokens(s, K) == (n, 0)
    gen = [False, True, True, False, True, False, True, True, True, False, False, True, True, True, True, True]
    s = Sequence(id=0, prompt=[1], env=object(), max_new=1, generated=gen, block_versions={0: 0, 1: 1, 2: 1})
    assert decoded_tokens(s, K, {1}) == (sum(gen[:12]), sum(gen[4:8]))


def test_close_env_calls_close_and_ignores_its_failure():
    class E:
        n = 0

        def close(self):
            E.n += 1
            raise RuntimeError("no")

    close_env(E())
    close_env(None)
    close_env(type("NoClose", (), {"close": 3})())
    assert E.n == 1


def test_state_round_trips_through_pickle_and_continues_like_the_original():
    cfg = DecodeConfig.preset("quality", max_new_tokens=15)
    model, part = StubLM(RULE), PartialRollouts()
    reqs = _requests(0, 3, 2, (2, 9))
    part.collect(model, cfg, [NewSequence(p, None, t) for p, t in reqs], 1, 0, max_batch=2)
    state = part.state()
    assert set(state) == {"group_sizes", "carried", "done"} and state["group_sizes"] is not part.group_sizes
    twin = PartialRollouts.from_state(pickle.loads(pickle.dumps(state)))
    assert twin.group_sizes == part.group_sizes and len(twin.carried) == len(part.carried) > 0
    assert len(twin.done) == len(part.done)
    a, sa = part.collect(model, cfg, [], 9, 1, max_batch=2)
    b, sb = twin.collect(model, cfg, [], 9, 1, max_batch=2)
    assert [(s.tag, s.canvas, s.block_versions) for s in a] == [(s.tag, s.canvas, s.block_versions) for s in b]
    assert sa == sb and isinstance(sa, CollectStats)


def test_a_state_with_finished_members_waiting_for_their_group_round_trips():
    """`done` (finished members whose group is incomplete) survives state() / from_state() too."""
    cfg = DecodeConfig.preset("quality", max_new_tokens=12, stop_at_eos=False)
    model, part = StubLM(RULE), PartialRollouts()
    new = [NewSequence(_prompt(0, 4), None, "a"), NewSequence(_prompt(1, 3), None, "a"),
           NewSequence(_prompt(2, 4), None, "b")]  # a's first member takes 3 blocks, its second 4
    out, _ = part.collect(model, cfg, new, 1, 0, max_batch=3)
    assert [s.tag for s in out] == ["b"]
    assert [s.tag for s in part.done] == ["a"] and [s.tag for s in part.carried] == ["a"]
    twin = PartialRollouts.from_state(pickle.loads(pickle.dumps(part.state())))
    assert [s.tag for s in twin.done] == ["a"]
    out, _ = twin.collect(model, cfg, [], 1, 0, max_batch=3)
    assert [s.prompt for s in out] == [new[0].prompt, new[1].prompt]


def test_sampled_sequences_carried_across_calls_decode_what_one_engine_decodes():
    """With sampling, each sequence continues its own generator across calls (same weights): its tokens equal
    those of one uninterrupted engine run with the same seeds."""
    import torch

    from rollout.engine import Engine

    cfg = DecodeConfig.preset("quality", max_new_tokens=14, temperature=1.0)
    prompts = [_prompt(i, n) for i, n in enumerate([3, 9, 5, 12, 1, 7])]
    gens = [torch.Generator().manual_seed(50 + i) for i in range(len(prompts))]
    part = PartialRollouts()
    out, _ = part.collect(StubLM(RULE, margin=3.0), cfg, [NewSequence(p, g, i // 2) for i, (p, g)
                                                         in enumerate(zip(prompts, gens))], 1, 0, max_batch=2)
    while part.carried or part.done:
        more, _ = part.collect(StubLM(RULE, margin=3.0), cfg, [], 1, 0, max_batch=2)
        out += more
    engine = Engine(StubLM(RULE, margin=3.0), cfg, max_batch=6, canvas_len=32)
    for i, p in enumerate(prompts):
        engine.submit(p, torch.Generator().manual_seed(50 + i))
    want = {tuple(s.prompt): s.canvas for s in engine.run()}
    assert len(out) == 6 and all(s.canvas[:len(want[tuple(s.prompt)])] == want[tuple(s.prompt)] for s in out)


@pytest.mark.parametrize("static, long", [(False, True), (True, True), (False, False), (True, False)])
def test_multi_turn_sequences_carried_over_decode_what_they_would_uninterrupted(static, long):
    """Multi-turn groups through several calls (quota 1, tools that take a while, so sequences are carried
    while waiting on them): every trajectory equals the plain multi-turn reference (the canvas is sized by
    max_total_tokens, not by the unused max_new_tokens); a prompt longer than max_total_tokens still fits the
    canvas (and stops at once); env steps run through the runner passed in, whose bound (here 1) holds across
    calls, not through one per call of mt.max_workers threads."""
    from ebpo.core.turns import round_up
    from rollout.env_steps import StepRunner
    from rollout.multiturn import MultiTurnConfig, trajectory_of
    from tests.support.stub_lm import ScriptEnv, StubTokenizer, reference_multiturn

    rule = Rule(eos=6, tool=8, c=2)
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=6, max_total_tokens=40,
                         observation_template="<o>{observation}</o>", max_workers=8)
    cfg = DecodeConfig.preset("quality", compiled_step=static, max_new_tokens=4)
    lock, running, most = __import__("threading").Lock(), [0], [0]

    class Env(ScriptEnv):
        def step(self, text):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                return super().step(text)
            finally:
                with lock:
                    running[0] -= 1

    lens = [5, 9, 13, 3, 42 if long else 11, 7]
    prompts = [_prompt(i, n) for i, n in enumerate(lens)]
    envs = [Env(3, obs=(1 + i % 3, 4), latency=0.02 * (i % 3)) for i in range(len(prompts))]
    new = [NewSequence(p, None, i // 2, e) for i, (p, e) in enumerate(zip(prompts, envs))]
    part, runner, tok, out = PartialRollouts(), StepRunner(1), StubTokenizer(), []
    model = StubLM(rule)
    for call in range(40):
        got, stats = part.collect(model, cfg, new if call == 0 else [], 1, 0, max_batch=3, tokenizer=tok, mt=mt,
                                  runner=runner)
        out += got
        assert stats.returned_tokens == sum(sum(s.generated) for s in got)
        if not part.carried and not part.done:
            break
    assert sorted(s.tag for s in out) == [0, 0, 1, 1, 2, 2] and most[0] == 1
    T = round_up(max(mt.max_total_tokens, max(lens) + 4), 4)
    for s in out:
        i = prompts.index(s.prompt)
        tr = trajectory_of(s, 0.0, 4)
        ref = reference_multiturn(prompts[i], ScriptEnv(3, obs=(1 + i % 3, 4)), rule, mt, T, tok)
        assert (tr.ids, tr.generated, tr.segment, tr.stop) == (ref["ids"], ref["generated"], ref["segment"],
                                                               ref["stop"])
        assert envs[i].texts == ref["texts"]
    assert [s.stop for s in out if len(s.prompt) == 42] == (["max_total_tokens"] if long else [])


def test_another_call_on_the_engine_never_waits_for_a_held_sequence():
    """A sequence held between calls is no prefix source: a new sequence with the same prompt, decoded by another
    client of the engine meanwhile (before and after a weight swap, which leaves the held keys stale until the
    held sequence is taken back), computes the prompt itself and finishes; the held one stays held."""
    from rollout.engine_holder import EngineHolder

    cfg = DecodeConfig.preset("m2t", max_new_tokens=6 * K, stop_at_eos=False)
    model, part = StubLM(RULE), PartialRollouts()
    engines = EngineHolder(model)
    reqs = [(_prompt(0, 2 * K), "a"), (_prompt(1, 2 * K + 1), "b")]
    part.collect(model, cfg, [NewSequence(p, None, t) for p, t in reqs], 1, 0, max_batch=2, engines=engines)
    (held,) = part.carried
    for swap in (False, True):
        if swap:
            model.version = 1
            engines.set_version(1)
        e = engines.engine
        other = e.submit(list(held.prompt), None, max_new_tokens=K)
        for _ in range(50):
            if not e.step():
                break
        assert other.status == "finished" and held.held and held.status != "finished"


@pytest.mark.parametrize("versions", [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
def test_a_long_lived_engine_and_a_fresh_engine_per_call_return_the_same_steps(versions):
    """GRPO-like groups (members share their prompt, so their keys can be shared) carried over several calls:
    a worker's long-lived engine, which holds the carried sequences between calls, returns what a fresh engine
    per call returns (the state a resumed run continues from), call by call: the same groups, tokens, block
    versions and forwards; under unchanged weights too, where the held sequences keep their keys."""
    from rollout.engine_holder import EngineHolder

    cfg = DecodeConfig.preset("quality", max_new_tokens=5 * K, stop_at_eos=False)

    def run(holder):
        model, part = StubLM(RULE), PartialRollouts()
        engines = EngineHolder(model) if holder else None
        calls = []
        for call, v in enumerate(versions):
            model.version = v
            new = [NewSequence(_prompt(g + 3 * call, 2 * K + g % 3), None, (call, g)) for g in range(2)
                   for _ in range(3)] if call < 3 else []
            out, stats = part.collect(model, cfg, new, 1, v, max_batch=4, engines=engines)
            calls.append(([(s.tag, s.canvas, dict(s.block_versions)) for s in out], stats.forwards,
                          [s.tag for s in part.carried]))
        return calls

    held, fresh = run(True), run(False)
    assert [c[1] for c in held] == [c[1] for c in fresh]
    assert held == fresh
