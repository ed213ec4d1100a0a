"""RolloutWorker (rollout/worker.py) in this process, without Ray.

The model loader, the decoder, the multi-turn runner, partial rollouts and the broadcast group are replaced by
recorders; the worker's own rules are checked: the decode config it builds, what a restarted worker comes back
with (the weights and version it is given, before any FP8 conversion), the version after each kind of load,
the sample dicts (plain values, the version that sampled them), the multi-turn and partial-rollout wiring,
the checkpoint of in-flight partial rollouts, and the sync group's life cycle.
"""
import pickle
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import rollout
import rollout.decoder as decoder
import rollout.engine as engine
import rollout.multiturn as multiturn
import rollout.partial as partial
import rollout.weight_sync as weight_sync
import rollout.worker as worker
from kernels.fp8 import FP8Linear
from rollout.config import DecodeConfig
from rollout.decoder import GenerationOutput
from rollout.weight_sync import WeightParts, state_dict_digest
from rollout.worker import RolloutWorker, _multi_turn_sample, _single_turn_sample


class Tiny(nn.Sequential):
    def __init__(self, seed=0):
        torch.manual_seed(seed)
        super().__init__(nn.Linear(16, 16), nn.Linear(16, 16, bias=False))
        self.config = SimpleNamespace(block_size=4, eos_token_id=1)


@pytest.fixture()
def loads(monkeypatch):
    rec = []

    def load_model(spec, device=None):
        rec.append(("model", spec, device))
        return Tiny()

    monkeypatch.setattr(worker, "load_model", load_model)
    monkeypatch.setattr(worker, "load_model_tokenizer", lambda spec: ("TOK", spec))
    return rec


def test_init_builds_the_config_and_loads_the_model(loads, monkeypatch):
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    decode = {"preset": "m2t", "max_new_tokens": 12}
    w = RolloutWorker("preset:tiny", decode, device="meta", multiturn={"max_turns": 2})
    assert decode == {"preset": "m2t", "max_new_tokens": 12}  # the caller's dict is left alone
    assert w.decode_config == DecodeConfig.preset("m2t", max_new_tokens=12)
    assert loads == [("model", "preset:tiny", torch.device("meta"))] and w.device == torch.device("meta")
    assert w.tokenizer == ("TOK", "preset:tiny") and not w.model.training
    assert (w.fp8, w.version, w.sync_group, w.partial, w.env_runner, w.env_factory) == \
        (False, 0, None, None, None, None)
    assert w.multiturn == {"max_turns": 2} and threads == []
    w = RolloutWorker("m", {"tau_mask": 0.4}, num_threads=3)
    assert w.decode_config == DecodeConfig.preset("speed", tau_mask=0.4) and threads == [3]
    assert w.multiturn == {} and w.device == torch.device("cpu")
    with pytest.raises(ValueError, match="DecodeConfig.tau_mask"):
        RolloutWorker("m", {"tau_mask": 3})


@pytest.mark.parametrize("fp8", [False, True])
def test_a_restarted_worker_comes_back_with_the_weights_and_version_it_is_given(loads, fp8):
    policy = Tiny(seed=5).state_dict()
    w = RolloutWorker("m", {}, weights=policy, weights_version=7, fp8=fp8)
    assert w.version == 7 and w.ping() == 7 and w.fp8 is fp8
    if fp8:
        assert isinstance(w.model[0], FP8Linear)  # converted after the float weights were loaded
        assert torch.allclose(w.model[0].bias, policy["0.bias"])
    else:
        assert state_dict_digest(w.model.state_dict()) == state_dict_digest(policy)
    fresh = RolloutWorker("m", {}, fp8=fp8)
    assert fresh.version == 0 and fresh.ping() == 0
    unversioned = RolloutWorker("m", {}, weights=policy, fp8=fp8)
    assert unversioned.version == 0  # weights without a version: version 0
    # the given weights are float weights, loaded strictly into the float model before any conversion
    with pytest.raises(RuntimeError, match="1.weight"):
        RolloutWorker("m", {}, weights={k: v for k, v in policy.items() if k != "1.weight"}, fp8=fp8)


def test_load_weights_paths_and_versions(loads, monkeypatch):
    w = RolloutWorker("m", {})
    sd = Tiny(seed=2).state_dict()
    assert w.load_weights(sd, 3) >= 0 and w.version == 3
    assert w.weights_digest() == state_dict_digest(sd)
    with pytest.raises(RuntimeError):  # strict: a missing key fails
        w.load_weights({k: v for k, v in sd.items() if k != "1.weight"}, 4)
    assert w.version == 3
    # object-store parts, fetched one at a time with ray.get
    fetched = []
    fake_ray = types.SimpleNamespace(get=lambda ref: fetched.append(ref) or ref)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    sd3 = Tiny(seed=3).state_dict()
    parts = WeightParts(refs=({"0.weight": sd3["0.weight"]}, {"0.bias": sd3["0.bias"], "1.weight": sd3["1.weight"]}))
    assert w.load_weights(parts, 9) >= 0 and w.version == 9 and len(fetched) == 2
    assert w.weights_digest() == state_dict_digest(sd3)
    with pytest.raises(ValueError, match="never arrived"):
        w.load_weights(WeightParts(refs=({"0.weight": sd3["0.weight"]},)), 10)
    assert w.version == 9
    # FP8: re-quantised from the float state dict, whole or in parts
    f = RolloutWorker("m", {}, fp8=True)
    sd4 = Tiny(seed=4).state_dict()
    f.load_weights(sd4, 11)
    assert f.version == 11 and torch.allclose(f.model[0].bias, sd4["0.bias"])
    f.load_weights(WeightParts(refs=(sd3,)), 12)
    assert f.version == 12 and torch.allclose(f.model[0].bias, sd3["0.bias"])


def gen_out(i):
    return GenerationOutput(prompt_ids=[9], token_ids=[i, 2], text=f"t{i}", num_forwards=2 + i, tpf=1.5, num_edits=i,
                            num_mbe_edits=0, trace=[0, 1], finished_by_eos=i == 0, tail_ids=[3, 4],
                            edit_log=[(0, 5, 6)], lev_drafts=[(4, [7, 8])])


def test_single_turn_sample():
    d = _single_turn_sample(gen_out(1), 6)
    assert d == {"token_ids": [1, 2], "text": "t1", "num_forwards": 3, "tpf": 1.5, "num_edits": 1,
                 "finished_by_eos": False, "tail_ids": [3, 4], "edit_log": [[0, 5, 6]], "lev_drafts": [[4, [7, 8]]],
                 "weights_version": 6}
    assert pickle.loads(pickle.dumps(d)) == d


class Traj:
    def __init__(self, turns, lev=None, forwards=4):
        self.prompt_ids, self.ids = [1, 2], [1, 2, 3, 4, 5]
        self.turns, self.num_forwards, self.num_generated, self.num_edits = turns, forwards, 6, 2
        if lev is not None:
            self.lev_drafts = lev

    def to_dict(self):
        return {"traj": True}


def test_multi_turn_sample():
    t = Traj([SimpleNamespace(text="a", finished_by="budget"), SimpleNamespace(text="b", finished_by="eos")],
             lev=[(0, (5, 6))])
    assert _multi_turn_sample(t, 3) == {"token_ids": [3, 4, 5], "text": "b", "num_forwards": 4, "tpf": 1.5,
                                        "num_edits": 2, "finished_by_eos": True, "weights_version": 3,
                                        "trajectory": {"traj": True}, "lev_drafts": [[0, [5, 6]]]}
    d = _multi_turn_sample(Traj([SimpleNamespace(text="a", finished_by="tool")], forwards=0), 1)
    assert (d["text"], d["finished_by_eos"], d["tpf"], d["lev_drafts"]) == ("a", False, 6.0, [])
    d = _multi_turn_sample(Traj([]), 1)
    assert (d["text"], d["finished_by_eos"]) == ("", False) and d["finished_by_eos"] is False


def test_generate_single_turn(loads, monkeypatch):
    calls = []

    def generate(model, ids, config, **kw):
        calls.append((model, ids, config, kw, torch.is_grad_enabled()))
        return [gen_out(i) for i in range(len(ids))]

    monkeypatch.setattr(rollout, "generate", generate)
    w = RolloutWorker("m", {"preset": "quality", "max_new_tokens": 5})
    w.version = 4
    out = w.generate([[1], [2, 3]], [10, 11])
    (model, ids, config, kw, grad), = calls
    assert model is w.model and ids == [[1], [2, 3]] and config == w.decode_config
    assert kw == {"tokenizer": w.tokenizer, "seeds": [10, 11], "engines": w.engines} and grad is False
    assert w.engines.model is w.model and w.engines.version == 4  # the worker's one engine holder, built once
    assert out == [_single_turn_sample(gen_out(i), 4) for i in range(2)]
    decode = {"max_new_tokens": 3}
    w.generate([[1]], [0], decode=decode)
    assert calls[-1][2] == DecodeConfig.preset("quality", max_new_tokens=3) and decode == {"max_new_tokens": 3}
    w.generate([[1]], [0], decode={"preset": "speed"})
    assert calls[-1][2] == DecodeConfig.preset("speed") and w.decode_config.max_new_tokens == 5


def test_generate_multi_turn(loads, monkeypatch):
    calls = []

    def run_episodes(model, prompts, rows, env_factory, config, mt, *, tokenizer, seeds, engines):
        assert engines is w.engines
        calls.append((model, prompts, rows, env_factory, config, mt, tokenizer, seeds))
        return [Traj([SimpleNamespace(text=f"r{i}", finished_by="eos")]) for i in range(len(prompts))]

    monkeypatch.setattr(multiturn, "run_episodes", run_episodes)
    factory = object()
    w = RolloutWorker("m", {}, env_factory=factory, multiturn={"max_turns": 3})
    w.version = 2
    out = w.generate([[1], [2]], [5, 6], decode={"max_new_tokens": 4}, rows=[{"a": 1}, {"a": 2}])
    (model, prompts, rows, env_factory, config, mt, tokenizer, seeds), = calls
    assert model is w.model and prompts == [[1], [2]] and rows == [{"a": 1}, {"a": 2}] and env_factory is factory
    assert config == DecodeConfig.preset("quality", max_new_tokens=4) and mt == multiturn.MultiTurnConfig(max_turns=3)
    assert tokenizer is w.tokenizer and seeds == [5, 6]
    assert [d["text"] for d in out] == ["r0", "r1"] and all(d["weights_version"] == 2 for d in out)
    w.generate([[1]], [5], rows=[{}])
    assert calls[-1][4] == w.decode_config
    with pytest.raises(ValueError) as err:
        w.generate([[1], [2]], [5, 6], rows=[{}])
    assert str(err.value) == "RolloutWorker.generate: one row per prompt (2), got 1"
    bare = RolloutWorker("m", {})
    with pytest.raises(ValueError) as err:
        bare.generate([[1]], [5], rows=[{}])
    assert str(err.value) == "RolloutWorker.generate: rows given (multi-turn) but the worker has no env_factory"


class FakeSeq:
    def __init__(self, tag, env=None, oldest=1):
        self.tag, self.env, self._oldest = tag, env, oldest

    def oldest_version(self):
        return self._oldest

    def versions_by_block(self):
        return {0: self._oldest}


class FakePartial:
    made = []

    def __init__(self):
        self.group_sizes, self.dropped_tags, self.calls = {"g1": 2, 3: 1}, {"b", 10, "a"}, []
        FakePartial.made.append(self)

    def collect(self, model, cfg, new, quota, version, **kw):
        self.calls.append((model, cfg, new, quota, version, kw))
        envs = [n.env for n in new]
        return [FakeSeq("s0", None, 2), FakeSeq("s1", envs[-1], 1)], partial.CollectStats(carried_in=4, forwards=9)


@pytest.mark.parametrize("multi", [False, True])
def test_generate_partial_wiring(loads, monkeypatch, multi):
    FakePartial.made = []
    monkeypatch.setattr(partial, "PartialRollouts", FakePartial)
    closed, runners = [], []
    monkeypatch.setattr(partial, "close_env", closed.append)
    rec = {"output": [], "traj": [], "start": []}
    monkeypatch.setattr(decoder, "_output", lambda *a: rec["output"].append(a) or gen_out(0))
    monkeypatch.setattr(engine, "eos_ids_of", lambda config: {config.eos_token_id})
    monkeypatch.setattr(multiturn, "trajectory_of", lambda *a: rec["traj"].append(a) or
                        Traj([SimpleNamespace(text=f"T{a[2]}", finished_by="eos")]))
    monkeypatch.setattr(multiturn, "start_episodes",
                        lambda *a: rec["start"].append(a) or [i + [len(a[0])] for i in a[2]])
    import rollout.env_steps as env_steps
    monkeypatch.setattr(env_steps, "StepRunner", lambda n: runners.append(n) or f"runner{n}")
    envs = []

    def factory():
        envs.append(object())
        return envs[-1]

    w = RolloutWorker("m", {"temperature": 0.5, "max_batch": 3}, env_factory=factory, multiturn={"max_workers": 2})
    w.version = 6
    rows = [{"r": 1}, {"r": 2}] if multi else None
    res = w.generate_partial([[1], [2]], [7, 8], ["g1", "g2"], quota=1, min_version=4, rows=rows, due_version=5)
    (p,) = FakePartial.made
    if multi:
        (st,) = rec["start"]
        assert st == (envs, rows, [[1], [2]], w.tokenizer, [7, 8],
                      multiturn.MultiTurnConfig(max_workers=2).observation_template)
    else:
        assert rec["start"] == []
    (model, cfg, new, quota, version, kw), = p.calls
    assert model is w.model and cfg == w.decode_config and quota == 1 and version == 6
    assert kw == dict(max_batch=3, min_version=4, due_version=5, tokenizer=w.tokenizer,
                      mt=multiturn.MultiTurnConfig(max_workers=2) if multi else None,
                      runner="runner2" if multi else None, engines=w.engines)
    assert [n.tag for n in new] == ["g1", "g2"]
    assert [n.prompt for n in new] == ([[1, 2], [2, 2]] if multi else [[1], [2]])
    assert [n.env for n in new] == (envs if multi else [None, None])
    g0 = torch.Generator().manual_seed(7)
    assert torch.equal(new[0].generator.get_state(), g0.get_state())  # seeded per prompt (sampling)
    assert res["stats"] == {"carried_in": 4, "carried_out": 0, "dropped": 0, "dropped_tokens": 0,
                            "carried_tokens": 0, "returned_tokens": 0, "forwards": 9}
    assert res["held"] == ["g1", 3] and res["dropped_tags"] == [10, "a", "b"]
    s0, s1 = res["samples"]
    assert s0 == {**_single_turn_sample(gen_out(0), 2), "tag": "s0", "block_versions": {0: 2}}
    assert [(a[0].tag, a[1], a[2], a[3]) for a in rec["output"]] == \
        [("s0", {1}, w.tokenizer, 4)] + ([] if multi else [("s1", {1}, w.tokenizer, 4)])
    assert [(a[0].tag, a[1], a[2]) for a in rec["traj"]] == ([("s1", 0.0, 4)] if multi else [])
    if multi:
        assert s1["text"] == "T4" and s1["weights_version"] == 1 and s1["tag"] == "s1" and closed == [envs[-1]]
        assert runners == [2]
    else:
        assert s1 == {**_single_turn_sample(gen_out(0), 1), "tag": "s1", "block_versions": {0: 1}} and closed == []
    # a second call keeps the same partial rollouts and step runner
    w.generate_partial([[3]], [9], ["g3"], quota=0, rows=[{}] if multi else None)
    assert len(FakePartial.made) == 1 and len(p.calls) == 2 and runners == ([2] if multi else [])
    assert p.calls[1][5]["min_version"] is None and p.calls[1][5]["due_version"] is None


def test_generate_partial_greedy_has_no_generators(loads, monkeypatch):
    FakePartial.made = []
    monkeypatch.setattr(partial, "PartialRollouts", FakePartial)
    monkeypatch.setattr(decoder, "_output", lambda *a: gen_out(0))
    w = RolloutWorker("m", {"block_size": 8})
    w.generate_partial([[1], [2]], [7, 8], ["a", "b"], quota=1)
    new = FakePartial.made[0].calls[0][2]
    assert [n.generator for n in new] == [None, None]


def test_partial_state_leaves_out_groups_that_do_not_pickle(loads):
    w = RolloutWorker("m", {})
    assert w.partial_state() is None
    good, bad = SimpleNamespace(tag="g", env=None), SimpleNamespace(tag="h", env=lambda: None)
    done = SimpleNamespace(tag="g", env=None)
    w.partial = partial.PartialRollouts(group_sizes={"g": 2, "h": 1}, carried=[good, bad], done=[done])
    st = w.partial_state()
    assert st["group_sizes"] == {"g": 2} and st["carried"] == [good] and st["done"] == [done]
    w.partial = partial.PartialRollouts(group_sizes={"g": 2}, carried=[good], done=[done])
    st = w.partial_state()
    assert st == {"group_sizes": {"g": 2}, "carried": [good], "done": [done]}
    w.restore_partial(st)
    assert isinstance(w.partial, partial.PartialRollouts) and w.partial.group_sizes == {"g": 2}
    assert w.partial.carried == [good]
    w.restore_partial(None)
    assert w.partial is None


def test_restoring_a_state_releases_what_the_engine_held_for_the_old_one(loads):
    w = RolloutWorker("m", {})
    w.restore_partial(None)  # no engine yet: nothing to release
    exported = []
    w.engines = SimpleNamespace(engine=SimpleNamespace(export=lambda: exported.append(1) or []))
    w.restore_partial({"group_sizes": {}, "carried": [], "done": []})
    assert exported == [1] and w.partial.carried == []


class FakeGroup:
    made = []

    def __init__(self, addr, port, rank, world_size, timeout_s, device):
        self.args, self.closed = (addr, port, rank, world_size, timeout_s, device), 0
        FakeGroup.made.append(self)

    def close(self):
        self.closed += 1

    def receive(self, version, consume):
        self.versions = getattr(self, "versions", []) + [version]
        for k, v in self.sd.items():
            consume({k: v})
        return {}


def test_sync_group_life_cycle(loads, monkeypatch):
    FakeGroup.made = []
    monkeypatch.setattr(weight_sync, "WeightBroadcastGroup", FakeGroup)
    w = RolloutWorker("m", {})
    with pytest.raises(RuntimeError) as err:
        w.receive_weights(1)
    assert str(err.value) == "receive_weights: this rollout worker is in no weight-sync group"
    w.join_sync_group("h", 5, 1, 3, 9.0)
    g1 = w.sync_group
    assert g1.args == ("h", 5, 1, 3, 9.0, "cpu")
    w.join_sync_group("h", 6, 2, 3, 4.0, device="meta")  # a re-formed group replaces (and closes) the old one
    g2 = w.sync_group
    assert g1.closed == 1 and g2.args == ("h", 6, 2, 3, 4.0, "meta")
    sd = Tiny(seed=8).state_dict()
    g2.sd = sd
    assert w.receive_weights(5) >= 0 and w.version == 5 and w.weights_digest() == state_dict_digest(sd)
    assert g2.versions == [5]  # the version asked for is the one received
    g2.sd = {k: v for k, v in sd.items() if k != "0.bias"}
    with pytest.raises(ValueError, match="0.bias"):
        w.receive_weights(6)
    assert w.version == 5
    w.close_sync_group()
    assert w.sync_group is None and g2.closed == 1
    w.close_sync_group()
    assert g2.closed == 1


def test_load_and_receive_return_the_elapsed_seconds(loads, monkeypatch):
    FakeGroup.made = []
    monkeypatch.setattr(weight_sync, "WeightBroadcastGroup", FakeGroup)
    w = RolloutWorker("m", {})
    sd = Tiny(seed=8).state_dict()
    clock = iter([500.0, 500.75, 600.0, 601.5])
    monkeypatch.setattr(worker.time, "perf_counter", lambda: next(clock))
    assert w.load_weights(sd, 1) == 0.75
    w.join_sync_group("h", 1, 1, 2, 5.0)
    w.sync_group.sd = sd
    assert w.receive_weights(2) == 1.5


def test_fp8_worker_receives_requantised_weights(loads, monkeypatch):
    FakeGroup.made = []
    monkeypatch.setattr(weight_sync, "WeightBroadcastGroup", FakeGroup)
    w = RolloutWorker("m", {}, fp8=True)
    w.join_sync_group("h", 1, 1, 2, 5.0)
    sd = Tiny(seed=9).state_dict()
    w.sync_group.sd = sd
    w.receive_weights(4)
    assert w.version == 4 and w.sync_group.versions == [4]
    assert isinstance(w.model[0], FP8Linear) and torch.allclose(w.model[0].bias, sd["0.bias"])
    ref = RolloutWorker("m", {}, fp8=True)
    ref.load_weights(sd, 4)
    assert w.weights_digest() == ref.weights_digest()
