"""Partial rollouts (ebpo.rl.partial_collect, the driver's side) through real Ray actors (tiny random model,
`trainer.partial_rollouts=true`): unfinished groups carry over to later steps with a weight version per block, the
lag bound holds, a frozen policy gives importance weights of exactly 1, and a run resumed from a checkpoint taken
with sequences in flight repeats the uninterrupted run. Without Ray (fast): `collect_partial` against stand-in
rollout workers, for the ledger's rules (groups in flight, worker assignment and quotas, the lag bound's versions,
lost and dropped work, the carried-token share, seeds, checkpoint state)."""
import contextlib
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

import ebpo.rl.partial_collect as pc  # noqa: E402 (imports ray)

from tests.support.async_runs import LEARNER, assert_same_steps, data, make_cfg, read_metrics, train  # noqa: E402,F401
from tests.support.ray_runs import ray_local  # noqa: E402,F401

PARTIAL = ("trainer.partial_rollouts=true", "rollout.prompts_per_step=3",
           "rollout.decode={max_new_tokens: 32, temperature: 1.0, max_batch: 6}")


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """The tiny random model with its EOS logit raised, so that sampled lengths vary (1 to 32 tokens, long-tailed): groups
    finish at different steps and some carry over."""
    import torch

    from ebpo.model.loading import load_model, load_model_tokenizer

    out = tmp_path_factory.mktemp("eos_model")
    model = load_model("preset:tiny@0")
    with torch.no_grad():  # EOS's logit up by about 3 along the mean final hidden state
        h = model.model(torch.randint(2, 100, (4, 32), generator=torch.Generator().manual_seed(0)))
        mu = h.reshape(-1, h.shape[-1]).mean(0)
        model.lm_head.weight[model.config.eos_token_id] += 3.0 * mu / mu.norm() ** 2
    model.save_pretrained(str(out))
    load_model_tokenizer("preset:tiny@0").save_pretrained(str(out))
    return str(out)


def cfg(data, run_dir, eos_model, *extra):
    return make_cfg(data, run_dir, f"model={eos_model}", *PARTIAL, *extra)


def test_partial_rollouts_carry_over_with_versions_per_block(ray_local, tmp_path, data, eos_model):
    run = train(cfg(data, tmp_path / "p", eos_model, "trainer.steps=4", "trainer.partial_overdue=drop", LEARNER))
    m = read_metrics(tmp_path / "p")
    assert sum(m[s]["partial/carried_token_share"] for s in range(1, 5)) > 0  # tokens decoded in earlier steps
    assert all(m[s]["train/samples"] == 9 for s in range(1, 5))  # the quota every step, whole groups
    for step, learner_version, versions in run.run.version_log:
        # the lag bound (max_staleness 0 + 1): oldest blocks at most one version behind, never ahead
        assert all(learner_version - 1 <= v <= learner_version for v in versions), (step, versions)
    assert any(v < lv for _, lv, vs in run.run.version_log for v in vs)  # some sample spans two versions
    # groups whose oldest block fell two versions behind were dropped and counted, never trained on
    assert m[4]["partial/dropped_total"] == sum(m[s]["partial/dropped"] for s in range(1, 5))
    assert m[4]["partial/lost_total"] == 0


def test_waiting_for_overdue_groups_trains_them_and_drops_nothing(ray_local, tmp_path, data, eos_model):
    # the default, trainer.partial_overdue=wait: a group the next step would drop is finished and trained now
    run = train(cfg(data, tmp_path / "w", eos_model, "trainer.steps=4", LEARNER))
    m = read_metrics(tmp_path / "w")
    assert m[4]["partial/dropped_total"] == 0
    assert all(m[s]["train/samples"] >= 9 and m[s]["train/samples"] % 3 == 0 for s in range(1, 5))  # quota + overdue
    assert any(m[s]["train/samples"] > 9 for s in range(1, 5))  # a group was overdue (the drop test drops one)
    for step, learner_version, versions in run.run.version_log:
        assert all(learner_version - 1 <= v <= learner_version for v in versions), (step, versions)
    # every group started is trained on or still in flight, once
    trained = sum(m[s]["train/samples"] for s in range(1, 5)) / 3
    assert m[4]["partial/groups_started"] == trained + m[4]["partial/in_flight_groups"]


def test_partial_rollouts_with_a_frozen_policy_weigh_exactly_one(ray_local, tmp_path, data, eos_model):
    train(cfg(data, tmp_path / "f", eos_model, "trainer.steps=3", "learner={n_draws: 2, mu: 1, lr: 0.0}"))
    m = read_metrics(tmp_path / "f")
    for s in range(1, 4):
        assert m[s]["actor/is_weight_min"] == 1.0 and m[s]["actor/is_weight_max"] == 1.0


def test_partial_rollouts_resume_exactly_with_sequences_in_flight(ray_local, tmp_path, data, eos_model):
    whole = tmp_path / "whole"
    train(cfg(data, whole, eos_model, "trainer.steps=4", LEARNER))
    part = tmp_path / "part"
    train(cfg(data, part, eos_model, "trainer.steps=4", "trainer.stop_after=2", LEARNER))
    assert read_metrics(part)[2]["partial/in_flight_groups"] > 0  # the checkpoint holds sequences in flight
    train(cfg(data, part, eos_model, "trainer.steps=4", f"trainer.resume={part}", LEARNER))
    assert_same_steps(read_metrics(whole), read_metrics(part), [3, 4])
    for step in (3, 4):
        assert read_metrics(part)[step]["partial/carried_token_share"] == read_metrics(whole)[step][
            "partial/carried_token_share"]


def test_partial_rollouts_in_the_asynchronous_loop_resume_exactly(ray_local, tmp_path, data, eos_model):
    """The checkpoint holds the steps collected ahead and the sequences carried by the rollout workers as of the
    last of them (the producer waits for the checkpoint before it starts another step)."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    extra = ("trainer.steps=4", "trainer.max_staleness=1", LEARNER)
    train(cfg(data, whole, eos_model, *extra))
    train(cfg(data, part, eos_model, *extra, "trainer.stop_after=2"))
    train(cfg(data, part, eos_model, *extra, f"trainer.resume={part}"))
    assert_same_steps(read_metrics(whole), read_metrics(part), [3, 4])


def test_partial_rollouts_in_the_asynchronous_loop(ray_local, tmp_path, data, eos_model):
    run = train(cfg(data, tmp_path / "a", eos_model, "trainer.steps=4", "trainer.max_staleness=1", LEARNER))
    m = read_metrics(tmp_path / "a")
    assert all(m[s]["train/samples"] >= 9 and m[s]["train/samples"] % 3 == 0 for s in range(1, 5))
    assert m[4]["partial/dropped_total"] == 0  # overdue groups are waited for (trainer.partial_overdue=wait)
    for step, learner_version, versions in run.run.version_log:
        assert all(learner_version - 2 <= v <= learner_version for v in versions), (step, versions)


def test_multi_turn_partial_rollouts_train_whole_episodes_within_the_lag_bound(ray_local, tmp_path):
    """The agent recipe with partial rollouts in the asynchronous loop, tools slow in half the episodes
    (ebpo.bench.slow_tools): episodes, some waiting on their tools at a step's end, carry over; whole groups are
    trained within the lag bound (2 versions), and every group started is trained or still in flight."""
    from ebpo.infra.config import load_config
    from ebpo.rl.config import RLConfig

    run_dir = tmp_path / "mt"
    run = train(load_config(RLConfig, "recipes/quickstart_agent.yaml", [
        "env.name=ebpo.bench.slow_tools:slow_calculator",
        "env.kwargs={max_turns: 3, timeout_s: 2.0, slow_s: 1.0, fast_s: 0.0, slow_share: 0.5}",
        "env.turns.max_workers=64", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.num_threads=1",
        "trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.steps=3", "trainer.dynamic_sampling=0",
        "trainer.filter_zero_std=false", "data.eval=null", f"trainer.run_dir={run_dir}", "trainer.tracking=none",
        "trainer.progress=false", "trainer.plots=false", "trainer.save_every=0", "reward.num_workers=1",
        "learner={n_draws: 1, mu: 1, lr: 0.0001}"]))
    m = read_metrics(run_dir)
    assert all(m[s]["train/samples"] >= 4 and m[s]["train/samples"] % 2 == 0 for s in range(1, 4))
    assert sum(m[s]["agent/tool_calls"] for s in range(1, 4)) > 0  # episodes used the (slow) tool
    assert m[3]["partial/dropped_total"] == 0 and m[3]["partial/lost_total"] == 0
    for step, learner_version, versions in run.run.version_log:
        assert all(learner_version - 2 <= v <= learner_version for v in versions), (step, versions)
    trained = sum(m[s]["train/samples"] for s in range(1, 4)) / 2
    assert m[3]["partial/groups_started"] == trained + m[3]["partial/in_flight_groups"]


@pytest.mark.slow
def test_a_dead_rollout_worker_loses_only_its_groups_in_flight_and_counts_them(ray_local, tmp_path, data, eos_model,
                                                                              monkeypatch):
    from ebpo.rl.actors import ResilientActor

    original, calls = ResilientActor.submit, {"n": 0}

    def submit(self, method, *args, **kwargs):
        ticket = original(self, method, *args, **kwargs)
        if self.name == "rollout-1" and method == "generate_partial":
            calls["n"] += 1
            if calls["n"] == 3:  # step 3: killed right after submit, with groups carried from steps 1-2
                ray.kill(self.handle, no_restart=True)
        return ticket

    monkeypatch.setattr(ResilientActor, "submit", submit)
    run = train(cfg(data, tmp_path / "k", eos_model, "trainer.steps=4", "rollout.num_workers=2",
                    "reward.num_actors=2", LEARNER))
    assert any("rollout-1 died during generate_partial" in e for e in run.events)
    m = read_metrics(tmp_path / "k")
    G = 3
    assert m[4]["partial/lost_total"] > 0 and m[4]["partial/lost_total"] % G == 0
    # every group started is trained on, dropped, lost or still in flight: counted once
    trained = sum(m[s]["train/prompts_drawn"] for s in range(1, 5))
    assert m[4]["partial/groups_started"] == (trained + m[4]["partial/dropped_total"] / G
                                              + m[4]["partial/lost_total"] / G + m[4]["partial/in_flight_groups"])


@pytest.mark.parametrize("extra,key", [
    (["trainer.partial_max_lag=0"], "trainer.partial_max_lag"),
    (["trainer.max_staleness=2", "trainer.partial_max_lag=1"], "trainer.partial_max_lag"),
    (["trainer.partial_extra_groups=-1"], "trainer.partial_extra_groups"),
    (["trainer.partial_overdue=keep"], "trainer.partial_overdue"),
    (["trainer.partial_rollouts=true", "trainer.dynamic_sampling=1", "trainer.filter_zero_std=true"],
     "trainer.dynamic_sampling"),
    (["trainer.partial_rollouts=true", "env.agent=examples/agents/calculator_agent.py:agent"], "env.agent"),
])
def test_partial_rollout_settings_are_checked_at_start_up(data, tmp_path, extra, key):
    from ebpo.infra.config import load_config  # noqa: F811
    from ebpo.rl.config import RLConfig  # noqa: F811

    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        load_config(RLConfig, None, ["model=preset:tiny@0", f"data.train={data}", "data.eval=null", *extra])


def test_the_learner_keeps_the_versions_a_carried_block_may_come_from(data):
    from ebpo.infra.config import load_config  # noqa: F811
    from ebpo.rl.config import RLConfig  # noqa: F811

    base = ["model=preset:tiny@0", f"data.train={data}", "data.eval=null", "trainer.partial_rollouts=true"]
    assert load_config(RLConfig, None, base).learner.max_staleness == 1
    assert load_config(RLConfig, None, base + ["trainer.max_staleness=1"]).learner.max_staleness == 2
    assert load_config(RLConfig, None, base + ["trainer.partial_max_lag=3"]).learner.max_staleness == 3
    assert load_config(RLConfig, None, base[:-1]).learner.max_staleness == 0


# The driver's ledger without Ray: `collect_partial` against stand-in rollout workers that keep the groups they are
# given and return, drop or forget them as each test says, checked against the rules of the module docstring and
# docs/concepts/async-partial.md ("How many are in flight", "The lag bound", "Faults", "Metrics").

class StandInWorker:
    """A rollout worker's `generate_partial` contract (rollout/worker.py): it keeps every sequence it is given by
    group tag; each call returns the groups `decide(worker, quota)` names as finished (all their members), drops
    the ones named dropped (counted in sequences), forgets the ones named forgotten (a restarted worker) and
    holds the rest. Every sample has 4 tokens; a group's tokens count as carried when it was given in an
    earlier call."""

    def __init__(self, decide=None, tokens=4):
        self.calls, self.held, self.age, self.tokens = [], {}, {}, tokens
        self.decide = decide or (lambda w, quota: {"finish": list(w.held)[:quota]})

    def submit(self, method, *args):
        assert method == "generate_partial"
        self.calls.append(args)
        ids, _seeds, tags = args[:3]
        for t, i in zip(tags, ids):
            self.held.setdefault(t, []).append(i)
            self.age.setdefault(t, len(self.calls))
        return len(self.calls)

    def result(self, ticket):
        quota = self.calls[ticket - 1][3]
        plan = self.decide(self, quota)
        samples, carried, dropped = [], 0, 0
        for t in plan.get("finish", []):
            for j, _ in enumerate(self.held.pop(t)):
                samples.append({"tag": t, "token_ids": [5] * self.tokens, "text": f"{t}/{j}", "num_forwards": 1,
                                "tpf": float(self.tokens), "num_edits": 0, "finished_by_eos": True})
                carried += self.tokens if self.age[t] < ticket else 0
        for t in plan.get("drop", []):
            dropped += len(self.held.pop(t))
        for t in plan.get("forget", []):
            del self.held[t]
        return {"samples": samples, "held": list(self.held), "dropped_tags": list(plan.get("drop", [])),
                "stats": {"carried_tokens": carried, "returned_tokens": self.tokens * len(samples),
                          "dropped": dropped}}

    def call(self, method, *args):
        self.calls.append((method, *args))
        return {"carried": sorted(self.held)} if method == "partial_state" else None


class StandInWeights:
    def __init__(self, version):
        self.version, self.held = version, []

    @contextlib.contextmanager
    def holding(self, weights):
        self.held.append(weights)
        yield


def _stand_in_run(workers, P=2, G=3, extra=None, max_lag=None, staleness=0, overdue="wait", version=5, multi_turn=False):
    rows = iter([{"prompt": f"q{i}", "answer": str(i)} for i in range(1000)])
    drawn = []

    def next_rows(n):
        drawn.append(n)
        return [next(rows) for _ in range(n)]

    cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=G, prompts_per_step=P),
                          trainer=SimpleNamespace(partial_extra_groups=extra, partial_max_lag=max_lag,
                                                  max_staleness=staleness, partial_overdue=overdue, seed=11),
                          env=SimpleNamespace(multi_turn=multi_turn), data=SimpleNamespace(prompt_field="prompt"))
    scored = []

    def score(inputs):
        scored.append(inputs)
        return [("score", x["completion"]) for x in inputs]

    return SimpleNamespace(cfg=cfg, partial=pc.PartialLedger(), sampler=SimpleNamespace(next=next_rows), drawn=drawn,
                           prompts=SimpleNamespace(encode=lambda row: [int(row["answer"]), 1]),
                           weights=StandInWeights(version), scored=scored,
                           cluster=SimpleNamespace(rollout_workers=workers, score=score))


@pytest.fixture
def records(monkeypatch):
    """`build_record` replaced by what it was given (the record's own tests are tests/rl/test_step.py)."""
    def build(run, step, rows, prompt_ids, samples, results, times):
        return SimpleNamespace(run=run, step=step, rows=rows, prompt_ids=prompt_ids, samples=samples,
                               results=results, times=times, metrics={})

    monkeypatch.setattr(pc, "build_record", build)


def _tags(worker):
    """The group tags of each generate_partial call (one per group, in order)."""
    return [list(dict.fromkeys(args[2])) for args in worker.calls if not isinstance(args[0], str)]


def test_groups_in_flight_are_prompts_per_step_plus_extra_and_refilled_by_what_left(records):
    w = StandInWorker()
    run = _stand_in_run([w], P=2, extra=None)
    m = pc.collect_partial(run, 1).metrics  # extra defaults to prompts_per_step: 4 groups in flight
    assert run.drawn == [4] and len(_tags(w)[0]) == 4
    assert m["partial/in_flight_groups"] == 2 and m["partial/groups_started"] == 4
    w.decide = lambda w, quota: {"finish": list(w.held)[:3], "drop": list(w.held)[3:4]}
    m = pc.collect_partial(run, 2).metrics  # draws 2 (back to 4); 3 finish, 1 dropped: 5 left the ledger
    assert run.drawn == [4, 2] and m["partial/in_flight_groups"] == 0 and m["partial/groups_started"] == 6
    pc.collect_partial(run, 3)
    assert run.drawn == [4, 2, 4]
    run = _stand_in_run([StandInWorker()], P=3, extra=1)
    pc.collect_partial(run, 1)
    assert run.drawn == [4]
    run = _stand_in_run([StandInWorker()], P=3, extra=0)
    assert pc.collect_partial(run, 1).metrics["partial/in_flight_groups"] == 0 and run.drawn == [3]


def test_the_nth_group_started_goes_to_worker_n_mod_w_with_its_share_of_the_quota(records):
    ws = [StandInWorker(), StandInWorker(), StandInWorker()]
    run = _stand_in_run(ws, P=4, G=2, extra=1)  # 5 groups: workers 0, 1, 2, 0, 1
    pc.collect_partial(run, 7)
    assert [len(_tags(w)[0]) for w in ws] == [2, 2, 1]
    assert sorted(w.calls[0][3] for w in ws) == [1, 1, 2] and sum(w.calls[0][3] for w in ws) == 4
    started = {t: n for n, t in enumerate(f"7:{i}" for i in range(5))}
    for k, w in enumerate(ws):
        ids, seeds, tags = w.calls[0][:3]
        assert all(started[t] % 3 == k for t in tags) and len(tags) == len(ids) == len(seeds)
        assert all(tags.count(t) == 2 for t in tags)  # the whole group, group_size sequences
    # the members of one group share its prompt ids; every sequence of the step has its own seed
    seeds = [s for w in ws for s in w.calls[0][1]]
    assert len(set(seeds)) == 10
    pc.collect_partial(run, 8)  # the quota finished: 4 new groups continue the count (5, 6, 7, 8)
    assert [len(_tags(w)[1]) for w in ws] == [1, 1, 2]


def test_the_lag_bound_decides_min_and_due_versions(records):
    """Sequences older than the learner that trains the step minus partial_max_lag are dropped by the worker
    (min_version); with partial_overdue=wait the groups the next step would drop are due now (due_version)."""
    cases = [  # (max_lag, max_staleness, overdue, held version, weights given) -> min_version, due_version
        (None, 0, "wait", 5, None, 4, 5),
        (None, 2, "wait", 5, None, 4, 5),  # trained by version 7, default lag 3
        (2, 1, "drop", 5, None, 4, None),
        (3, 1, "wait", 5, 9, 7, 8),  # the weights this step holds decide, not the run's
    ]
    for lag, s, overdue, held, given, lo, due in cases:
        w = StandInWorker()
        run = _stand_in_run([w], max_lag=lag, staleness=s, overdue=overdue, version=held)
        weights = None if given is None else SimpleNamespace(version=given)
        pc.collect_partial(run, 1, weights)
        assert w.calls[0][4:] == (lo, None, due), (lag, s, overdue)
        assert run.weights.held == [weights]  # the workers hold them while they decode


def test_lost_and_dropped_work_is_counted_in_sequences_and_every_group_once(records):
    G = 3
    ws = [StandInWorker(), StandInWorker()]
    run = _stand_in_run(ws, P=2, G=G, extra=2)  # 4 groups: 2 per worker
    pc.collect_partial(run, 1)  # each worker finishes 1, holds 1

    def carried(w):
        return [t for t in w.held if w.age[t] < len(w.calls)]

    ws[0].decide = lambda w, q: {"forget": carried(w)}  # worker 0 restarted: its carried group is gone
    ws[1].decide = lambda w, q: {"drop": carried(w), "finish": [t for t in w.held if t not in carried(w)]}
    m = pc.collect_partial(run, 2).metrics
    assert (m["partial/lost"], m["partial/dropped"]) == (G, G)
    ws[1].decide = lambda w, q: {}
    m = pc.collect_partial(run, 3).metrics
    assert m["partial/lost"] == G and m["partial/dropped"] == 0
    assert m["partial/lost_total"] == 2 * G and m["partial/dropped_total"] == G
    assert (run.partial.lost, run.partial.dropped) == (2 * G, G)
    trained = sum(len(x) for x in run.scored) // G
    assert m["partial/groups_started"] == trained + (m["partial/lost_total"] + m["partial/dropped_total"]) / G \
        + m["partial/in_flight_groups"]
    assert m["partial/in_flight_groups"] == len(ws[0].held) + len(ws[1].held) > 0


def test_returned_groups_are_trained_with_their_rows_prompts_and_carried_share(records):
    G = 2
    w = StandInWorker(lambda w, q: {"finish": list(w.held)[:q]})
    run = _stand_in_run([w], P=1, G=G, extra=1)
    rec = pc.collect_partial(run, 1)  # group 0 finishes at once, group 1 carries over
    assert rec.metrics["partial/carried_token_share"] == 0.0
    assert [r["prompt"] for r in rec.rows] == ["q0"] and rec.prompt_ids == [[0, 1]] * G
    w.decide = lambda w, q: {"finish": list(w.held)}  # group 1 (carried) and group 2 (new)
    rec = pc.collect_partial(run, 2)
    assert [r["prompt"] for r in rec.rows] == ["q1", "q2"] and rec.prompt_ids == [[1, 1]] * G + [[2, 1]] * G
    assert rec.metrics["partial/carried_token_share"] == 0.5  # 8 of the 16 tokens were decoded in step 1
    assert [x["prompt"] for x in run.scored[-1]] == ["q1"] * G + ["q2"] * G
    assert [x["completion"] for x in run.scored[-1]] == [s.text for s in rec.samples]
    w.decide = lambda w, q: {}
    assert pc.collect_partial(run, 3).metrics["partial/carried_token_share"] == 0.0  # nothing returned
    assert set(rec.times) == {"timing_s/rollout", "timing_s/reward"} and rec.step == 2
    one = StandInWorker(lambda w, q: {}, tokens=1)
    run = _stand_in_run([one], P=1, G=1, extra=0)
    pc.collect_partial(run, 1)
    one.decide = lambda w, q: {"finish": list(w.held)}
    assert pc.collect_partial(run, 2).metrics["partial/carried_token_share"] == 1.0  # 1 token, decoded in step 1


def test_multi_turn_groups_take_their_rows_and_their_decoded_prompts(records):
    traj = {"prompt_ids": [9, 9, 9], "ids": [9, 9, 9, 5, 5, 5, 5], "generated": [False] * 3 + [True] * 4,
            "segment": [0, 0, 0, 1, 1, 1, 1], "turns": []}

    class MultiTurn(StandInWorker):
        def result(self, ticket):
            out = super().result(ticket)
            for d in out["samples"]:
                d["trajectory"] = traj
            return out

    w = MultiTurn()
    run = _stand_in_run([w], P=1, G=2, extra=0, multi_turn=True)
    rec = pc.collect_partial(run, 1)
    assert w.calls[0][5] == [{"prompt": "q0", "answer": "0"}] * 2  # the row of every sequence, for its environment
    assert rec.prompt_ids == [[9, 9, 9]] * 2  # as decoded (the environment's first observation included)
    assert [x["trajectory"] for x in run.scored[-1]] == [traj] * 2  # for trajectory rewards
    single = StandInWorker()
    pc.collect_partial(_stand_in_run([single], P=1, G=2, extra=0), 1)
    assert single.calls[0][5] is None


def test_the_ledger_and_the_workers_state_round_trip():
    ledger = pc.PartialLedger(pending={"1:0": {"row": {"prompt": "q"}, "ids": [1], "worker": 1}}, dropped=6, lost=3,
                              started=9)
    state = ledger.state()
    again = pc.PartialLedger.from_state(state)
    assert again == ledger and again.pending is not ledger.pending
    ws = [StandInWorker(), StandInWorker(), StandInWorker()]
    ws[1].held = {"1:0": [[1]]}
    run = SimpleNamespace(partial=ledger, cluster=SimpleNamespace(rollout_workers=ws))
    saved = pc.partial_state(run)
    assert saved == {"ledger": state, "workers": [{"carried": []}, {"carried": ["1:0"]}, {"carried": []}]}
    pc.restore_partial(run, {"ledger": state, "workers": saved["workers"][:2]})
    assert run.partial == ledger and run.partial is not ledger
    assert [w.calls[-1] for w in ws] == [("restore_partial", {"carried": []}), ("restore_partial", {"carried": ["1:0"]}),
                                         ("restore_partial", None)]  # a worker beyond the saved ones starts empty
    pc.restore_partial(run, None)  # a checkpoint written without partial rollouts
    assert run.partial == pc.PartialLedger() and [w.calls[-1] for w in ws] == [("restore_partial", None)] * 3


def test_a_full_ledger_draws_nothing_and_spare_workers_get_no_quota(records):
    w = StandInWorker(lambda w, q: {})
    run = _stand_in_run([w], P=2, extra=1)
    pc.collect_partial(run, 1)
    pc.collect_partial(run, 2)  # nothing finished: the 3 groups in flight are all there may be
    assert run.drawn == [3, 0] and len(w.calls) == 2 and w.calls[1][0] == []
    ws = [StandInWorker() for _ in range(3)]
    pc.collect_partial(_stand_in_run(ws, P=2, extra=0), 1)  # more workers than groups a step trains on
    assert [w.calls[0][3] for w in ws] == [1, 1, 0]


def test_new_groups_get_the_seeds_the_synchronous_collect_gives_the_same_draw(records):
    """Sample n of a step's new draws (group i, member j: n = i * group_size + j) decodes with
    derive_seed(trainer.seed, step, n), as in `ebpo.rl.step.collect`: runs with other seeds or other steps
    differ, and a partial step whose groups all finish samples what the synchronous step samples."""
    from ebpo.rl.prompts import derive_seed

    def seeds(seed, step, W=2):
        ws = [StandInWorker() for _ in range(W)]
        run = _stand_in_run(ws, P=2, G=3, extra=1)
        run.cfg.trainer.seed = seed
        for s in range(1, step + 1):
            pc.collect_partial(run, s)
        return {t: sd for w in ws for tags, sd in ((w.calls[-1][2], w.calls[-1][1]),) for t, sd in zip(tags, sd)}, ws

    got, ws = seeds(11, 1)
    by_tag = {}
    for w in ws:
        for tag, sd in zip(w.calls[0][2], w.calls[0][1]):
            by_tag.setdefault(tag, []).append(sd)
    n = 0
    for i in range(3):  # the step's draws in order: tags 1:0, 1:1, 1:2
        assert by_tag[f"1:{i}"] == [derive_seed(11, 1, n + j) for j in range(3)]
        n += 3
    assert set(seeds(12, 1)[0].values()).isdisjoint(got.values())
    assert set(seeds(11, 2)[0].values()).isdisjoint(got.values())


def test_every_worker_s_lost_dropped_and_carried_work_adds_up(records):
    """Two workers in one step: each loses two groups, drops one, returns one carried group; sums over workers and
    over groups, the ledger forgets exactly the groups that left."""
    G = 2
    ws = [StandInWorker(lambda w, q: {}, tokens=1), StandInWorker(lambda w, q: {}, tokens=1)]
    run = _stand_in_run(ws, P=4, G=G, extra=4)  # 8 groups, 4 per worker, none finishes in step 1
    pc.collect_partial(run, 1)
    for w in ws:
        w.decide = lambda w, q: {"drop": list(w.held)[:1], "finish": list(w.held)[1:2], "forget": list(w.held)[2:4]}
    rec = pc.collect_partial(run, 2)
    m = rec.metrics
    assert (m["partial/dropped"], m["partial/lost"]) == (2 * G, 4 * G)
    assert m["partial/carried_token_share"] == 1.0  # both returned groups were decoded in step 1, 1 token each
    left = {t for w in ws for t in w.held}
    assert set(run.partial.pending) == left and m["partial/in_flight_groups"] == len(left) == 0
    assert rec.results == [("score", s.text) for s in rec.samples] and len(rec.results) == 2 * G and rec.run is run


def test_rewards_see_each_sample_s_decode_trace(records):
    w = StandInWorker()
    run = _stand_in_run([w], P=1, G=2, extra=0)
    pc.collect_partial(run, 1)
    assert [x["metadata"]["decode"] for x in run.scored[-1]] == [{"forwards": 1, "tokens": 4}] * 2
