"""Rules of the RL records and of the weight versions that no happy-path test pins (issue 40): `StepRecord`
refuses a keep mask of any dtype but bool and a field of the wrong shape; the weight-version bound refuses a
version newer than the learner's as well as one too old; a restarted rollout worker gets back the version it
held, not the newest one published."""
import itertools
import types

import pytest
import torch

from ebpo.rl.async_behaviour import check_versions
from ebpo.rl.records import RolloutSample, StepRecord
from ebpo.rl.weights import PolicyWeights, Weights

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]


def _sample(i):
    return RolloutSample(token_ids=[i, i + 1], text=f"s{i}", num_forwards=1, tpf=2.0, num_edits=0, finished_by_eos=True)


def _record(B, **over):
    fields = dict(step=1, rows=[{}] * B, prompt_ids=[[1, 2]] * B, samples=[_sample(i) for i in range(B)],
                  scores=torch.zeros(B), group_ids=torch.zeros(B, dtype=torch.long), advantages=torch.zeros(B),
                  keep=torch.ones(B, dtype=torch.bool), metrics={}, times={}, sampler_after={})
    fields.update(over)
    return StepRecord(**fields)


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_step_record_keep_must_be_bool(B, dtype):
    keep = (torch.arange(B) % 2 == 0).to(dtype)
    if dtype == torch.bool:
        rec = _record(B, keep=keep)
        assert rec.kept() == [i for i in range(B) if i % 2 == 0]
    else:
        with pytest.raises(ValueError, match=r"StepRecord\.keep.*bool"):
            _record(B, keep=keep)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", ["scores", "group_ids", "advantages", "keep"])
def test_step_record_refuses_each_field_of_the_wrong_shape(B, name):
    good = getattr(_record(B), name)
    for bad in (good[:-1], torch.cat([good, good[:1]]), good[:, None], good.tolist()):
        with pytest.raises(ValueError, match=rf"StepRecord\.{name}"):
            _record(B, **{name: bad})
    with pytest.raises(ValueError, match=r"StepRecord\.prompt_ids"):
        _record(B, prompt_ids=[[1]] * (B + 1))


def test_weight_versions_outside_current_minus_s_to_current_are_refused():
    """Every batch of versions, every learner version c and staleness s: refused exactly when some version is
    newer than c or older than c - s."""
    for c, s in itertools.product(range(0, 6), range(0, 4)):
        for vs in itertools.product(range(c - s - 2, c + 3), repeat=2):
            ok = all(c - s <= v <= c for v in vs)
            if ok:
                check_versions(torch.tensor(vs), c, s)
            else:
                with pytest.raises(ValueError, match="weight_version"):
                    check_versions(torch.tensor(vs), c, s)


def test_the_learner_refuses_a_sample_newer_than_its_weights():
    from ebpo.rl.learner import EBPOLearner, LearnerConfig
    from test_async_offpolicy import _batch
    from test_learner_group import _model

    model = _model()
    learner = EBPOLearner(model, LearnerConfig(lr=0.01, n_draws=2, seed=0, max_staleness=2))
    learner.update(_batch(model, 0, [0, 0]))  # the learner is at version 1 now
    for versions in ([1, 2], [2, 2], [0, 5]):
        with pytest.raises(ValueError, match="weight_version"):
            learner.update(_batch(model, 1, versions))
    learner.update(_batch(model, 1, [0, 1]))  # in range: accepted


class _Worker:
    """A rollout worker as `PolicyWeights` sees it (a ResilientActor): records the versions it loads."""

    def __init__(self):
        self.loaded, self.restarts = [], 0

    def submit(self, method, *args):
        return method, args

    def result(self, ticket):
        method, args = ticket
        if method == "load_weights":
            self.loaded.append(args[1])


class _Learner:
    def __init__(self):
        self.parts = 0

    def weight_parts(self, bucket_bytes):
        self.parts += 1
        return f"parts{self.parts}"


def _weights(mode="object_store"):
    cfg = types.SimpleNamespace(weight_sync=mode, bucket_mb=1.0, sync_timeout_s=10.0, learner_gpus=0, rollout_gpus=0)
    pw = PolicyWeights(None, cfg, lambda msg: None)
    pw.learner, pw.rollout_workers = _Learner(), [_Worker(), _Worker()]
    return pw


def test_a_restarted_worker_gets_the_version_it_held_not_the_newest_published():
    """Asynchronous loop: versions are published ahead of the one the workers hold; whichever version is held
    when a worker restarts, and however many newer ones exist, the restart brings back that version."""
    for n_published, held in [(3, 1), (3, 2), (3, 3), (5, 1), (5, 4), (2, 0)]:
        pw = _weights()
        published = [pw.current()] + [pw.publish() for _ in range(n_published)]
        assert [w.version for w in published] == list(range(n_published + 1))
        with pw.holding(published[held]):
            assert all(w.loaded[-1] == held for w in pw.rollout_workers)
            r = pw.restart_weights()
            assert r == {"weights": published[held].ref, "weights_version": held}
        # after the block the workers still hold that version: a restart then brings it back as well
        assert pw.restart_weights() == {"weights": published[held].ref, "weights_version": held}


def test_holding_a_version_already_held_loads_nothing_and_a_new_one_loads_once():
    pw = _weights()
    v = [pw.current()] + [pw.publish() for _ in range(3)]
    with pw.holding(v[1]):
        pass
    with pw.holding(v[1]):
        pass
    with pw.holding(None):
        assert pw.restart_weights()["weights_version"] == 1
    with pw.holding(v[3]):
        pass
    assert all(w.loaded == [1, 3] for w in pw.rollout_workers)
    assert pw.restart_weights() == {"weights": v[3].ref, "weights_version": 3}


def test_synchronous_restart_gets_the_last_synced_version():
    pw = _weights()
    assert pw.restart_weights() == {"weights": None, "weights_version": 0}  # the base model before any sync
    for k in range(1, 4):
        pw.sync()
        assert all(w.loaded[-1] == k for w in pw.rollout_workers)
        assert pw.restart_weights() == {"weights": f"parts{k}", "weights_version": k}
    pw.detach()
    assert pw.restart_weights()["weights_version"] == 3


def test_weights_record_is_version_and_ref():
    assert Weights(3, "r") == (3, "r") and Weights(3, "r").version == 3
