"""`rollout.partial.PartialRollouts`: steps take the groups that finished, the rest carry over at a block
boundary; nothing is lost, staleness drops are counted, and a pickled state continues exactly."""
import pickle

import torch

from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from rollout import DecodeConfig, generate
from rollout.decoder import _output
from rollout.engine import eos_ids_of
from rollout.partial import NewSequence, PartialRollouts, decoded_tokens

G = 2  # sequences per group


def _cfg(**kw):
    # eos_boost models stop at different lengths: a long-tailed batch
    return DecodeConfig.preset("speed", max_new_tokens=40, temperature=0.9, **kw)


def _new(step, n_groups, prompt_len=5):
    out = []
    for g in range(n_groups):
        prompt = [0] + [(7 * step + 3 * g + j) % 50 + 1 for j in range(prompt_len)]
        for j in range(G):
            seed = 1000 * step + 10 * g + j
            out.append(NewSequence(prompt, torch.Generator().manual_seed(seed), f"{step}:{g}"))
    return out


def _run(model, cfg, steps, quota, new_groups, state_at=None):
    """Steps of partial collection with the same weights (versions 0, 1, ...); returns {tag: [canvases]} in the
    order returned, and the per-step stats; with state_at, the state is pickled after that step and the rest
    runs on the unpickled copy."""
    pr, got, stats = PartialRollouts(), {}, []
    for step in range(steps):
        seqs, st = pr.collect(model, cfg, _new(step, new_groups), quota, version=step, max_batch=6)
        stats.append(st)
        for s in seqs:
            got.setdefault(s.tag, []).append(s)
        if state_at == step:
            pr = PartialRollouts.from_state(pickle.loads(pickle.dumps(pr.state())))
    return pr, got, stats


def test_every_group_comes_back_once_whole_with_the_tokens_its_seed_decodes():
    model = make_model(0, eos_boost=6.0)
    cfg, steps = _cfg(), 6
    pr, got, stats = _run(model, cfg, steps=steps, quota=2, new_groups=3)
    assert all(len(v) == G for v in got.values())  # whole groups only
    assert sum(len(v) for v in got.values()) == steps * 2 * G  # the quota, every step
    assert sum(st.carried_out for st in stats[:-1]) > 0  # something did carry over
    assert sum(st.carried_tokens for st in stats) > 0  # ... and came back later
    # same weights in every step: a carried sequence decodes exactly what one uninterrupted decode gives
    eos = eos_ids_of(model.config)
    for step in range(steps):
        for g in range(3):
            tag = f"{step}:{g}"
            if tag not in got:
                continue
            news = [s for s in _new(step, 3) if s.tag == tag]
            refs = [generate(model, [s.prompt], cfg, generators=[s.generator])[0].token_ids for s in news]
            mine = [_output(q, eos, None, model.config.block_size).token_ids for q in got[tag]]
            assert sorted(mine) == sorted(refs), tag
    # nothing lost: returned + still held = submitted
    held = {s.tag for s in pr.carried + pr.done}
    assert set(got) | held == {f"{st}:{g}" for st in range(steps) for g in range(3)}
    assert not set(got) & held


def test_a_pickled_state_continues_exactly():
    model = make_model(0, eos_boost=6.0)
    cfg = _cfg()
    _, plain, _ = _run(model, cfg, steps=4, quota=2, new_groups=3)
    _, resumed, _ = _run(model, cfg, steps=4, quota=2, new_groups=3, state_at=1)
    assert list(plain) == list(resumed)  # the same groups, returned in the same order
    for tag in plain:
        assert [s.canvas for s in plain[tag]] == [s.canvas for s in resumed[tag]]
        assert [s.block_versions for s in plain[tag]] == [s.block_versions for s in resumed[tag]]


def test_carried_sequences_record_each_blocks_version_and_stale_groups_are_dropped_and_counted():
    model = make_model(0, eos_boost=6.0)
    cfg = _cfg()
    pr = PartialRollouts()
    pr.collect(model, cfg, _new(0, 3), 1, version=0, max_batch=6)
    carried = list(pr.carried)
    assert carried and all(s.at_block_boundary for s in carried)
    seqs, _ = pr.collect(model, cfg, _new(1, 1), 1, version=1, max_batch=6)
    for s in seqs:
        v = [x for x in s.versions_by_block() if x >= 0]
        assert v == sorted(v) and set(v) <= {0, 1}
    # version 3 with min_version 2: everything decoded under 0 or 1 is too old
    old_tags = {s.tag for s in pr.carried + pr.done if s.oldest_version() is not None and s.oldest_version() < 2}
    n_old = sum(1 for s in pr.carried + pr.done if s.tag in old_tags)
    tokens = sum(decoded_tokens(s, model.config.block_size)[0] for s in pr.carried + pr.done if s.tag in old_tags)
    assert old_tags
    seqs, st = pr.collect(model, cfg, _new(3, 2), 1, version=3, min_version=2, max_batch=6)
    assert st.dropped == n_old and st.dropped_tokens == tokens and pr.dropped_tags == old_tags
    assert not ({s.tag for s in seqs} & old_tags) and not ({s.tag for s in pr.carried + pr.done} & old_tags)


def _lagged_run(model, cfg, due: bool, steps=6, lag=2):
    """Steps at versions 0, 1, ... with the lag bound `lag` (min_version = version - lag), 1 group trained a
    step and 2 started (so stragglers pile up); with `due`, each call also waits for the groups the next call
    would drop. Returns per step (returned tags, stats, tags held after the call with their oldest versions)."""
    pr, out = PartialRollouts(), []
    for v in range(steps):
        min_version = v - lag
        seqs, st = pr.collect(model, cfg, _new(v, 2), 1, version=v, max_batch=6, min_version=min_version,
                              due_version=min_version + 1 if due else None)
        held = {}
        for s in pr.carried + pr.done:
            if s.oldest_version() is not None:
                held[s.tag] = min(held.get(s.tag, v), s.oldest_version())
        out.append(([s.tag for s in seqs], st, held, [s for s in seqs]))
    return out


def test_waiting_for_overdue_groups_drops_nothing_and_returns_them_beyond_the_quota():
    model = make_model(0, eos_boost=6.0)
    cfg = _cfg()
    dropping = _lagged_run(model, cfg, due=False)
    assert sum(st.dropped for _, st, _, _ in dropping) > 0  # the schedule does make stragglers pass the bound
    waiting = _lagged_run(model, cfg, due=True)
    started = {f"{v}:{g}" for v in range(6) for g in range(2)}
    returned = [t for tags, _, _, _ in waiting for t in dict.fromkeys(tags)]
    assert len(returned) == len(set(returned))  # each group once
    for v, (tags, st, held, seqs) in enumerate(waiting):
        assert st.dropped == 0
        groups = list(dict.fromkeys(tags))
        assert len(groups) >= 1  # the quota, and any overdue group beyond it
        # the rule: after a call with due_version d = v - lag + 1, nothing left in flight is older than d, so
        # the next call (min_version d) has nothing to drop
        assert all(oldest >= v - 2 + 1 for oldest in held.values()), (v, held)
        # every returned sequence is within the bound of the step that trains it, and whole groups come back
        assert all(s.oldest_version() >= v - 2 for s in seqs)
        assert all(tags.count(t) == G for t in groups)
    in_flight = set(waiting[-1][2])
    assert set(returned) | in_flight <= started and not set(returned) & in_flight
    # more groups are trained than with dropping, and at least one step returned more than its quota
    assert len(returned) > len({t for tags, _, _, _ in dropping for t in tags})
    assert any(len(set(tags)) > 1 for tags, _, _, _ in waiting)


class SlowScript:
    """Answers turn k with `obs<k>` after `delay` seconds; done after `n` turns (a picklable environment)."""

    def __init__(self, n, delay):
        self.n, self.k, self.delay = n, 0, delay

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        import time

        time.sleep(self.delay)
        self.k += 1
        return (f"obs{self.k}", 0.0, self.k >= self.n, {})


def test_multi_turn_sequences_carry_over_waiting_on_their_tools_and_decode_what_they_would_uninterrupted():
    """Groups of episodes of 1-3 turns with slow tools: a step ends while some sequences wait on env.step; they
    carry over (their pending step with them, through a pickled state too) and end with the tokens of an
    uninterrupted multi-turn rollout with the same seeds and weights."""
    from ebpo.model.loading import load_model_tokenizer
    from rollout.multiturn import MultiTurnConfig, generate_multiturn

    tok = load_model_tokenizer("tiny-sft")
    model = make_model(0)
    cfg = DecodeConfig.preset("speed", temperature=0.9)
    mt = MultiTurnConfig(max_turn_tokens=16, stop_at_tool_call=False, max_total_tokens=160)
    turns = {(s, g, j): 1 + (s + g + j) % 3 for s in range(4) for g in range(3) for j in range(G)}

    def new(step):
        return [NewSequence([0] + [(5 * step + 3 * g + k) % 50 + 1 for k in range(6)],
                            torch.Generator().manual_seed(1000 * step + 10 * g + j), f"{step}:{g}",
                            SlowScript(turns[step, g, j], 0.05 * (1 + j)))
                for g in range(3) for j in range(G)]

    pr, got, waiting_carried = PartialRollouts(), {}, 0
    for step in range(4):
        seqs, st = pr.collect(model, cfg, new(step), 2, version=step, max_batch=4, tokenizer=tok, mt=mt)
        waiting_carried += sum(s.status == "waiting" for s in pr.carried)
        for s in seqs:
            got.setdefault(s.tag, []).append(s)
        if step == 1:
            pr = PartialRollouts.from_state(pickle.loads(pickle.dumps(pr.state())))
    assert waiting_carried > 0  # some sequences crossed a step while their tool ran
    assert all(len(v) == G for v in got.values()) and len(got) == 8
    for tag, members in got.items():
        step, g = map(int, tag.split(":"))
        news = [s for s in new(step) if s.tag == tag]
        ref = generate_multiturn(model, [s.prompt for s in news], [s.env for s in news], cfg, mt, tokenizer=tok,
                                 seeds=[1000 * step + 10 * g + j for j in range(G)])
        assert sorted(s.canvas[:s.length] for s in members) == sorted(t.ids for t in ref), tag
        for s in members:
            v = [x for x in s.versions_by_block() if x >= 0]
            assert v == sorted(v) and v[0] >= step
