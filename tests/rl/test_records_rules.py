"""Rules of the RL records and of the weight versions that no happy-path test pins (issue 40): `StepRecord`
refuses a keep mask of any dtype but bool and a field of the wrong shape; the weight-version bound refuses a
version newer than the learner's as well as one too old; a restarted rollout worker gets back the version it
held, not the newest one published."""
import itertools
import types

import pytest
import torch

from ebpo.rl.async_behaviour import check_versions
from ebpo.rl.records import LearnerBatch, RolloutSample, StepRecord, build_learner_batch
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
        with pytest.raises(ValueError, match=rf"^StepRecord\.keep: expected bool, got {dtype}$"):
            _record(B, keep=keep)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("name", ["scores", "group_ids", "advantages", "keep"])
def test_step_record_refuses_each_field_of_the_wrong_shape(B, name):
    good = getattr(_record(B), name)
    for bad in (good[:-1], torch.cat([good, good[:1]]), good[:, None], good.tolist()):
        got = r"\(.*\)" if isinstance(bad, torch.Tensor) else "list"
        with pytest.raises(ValueError, match=rf"^StepRecord\.{name}: expected a tensor of shape \({B},\), got {got}$"):
            _record(B, **{name: bad})
    with pytest.raises(ValueError, match=rf"^StepRecord\.prompt_ids: {B + 1} prompts for {B} samples$"):
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
    from tests.rl.test_async_offpolicy import _batch
    from tests.support.models import small_lm

    model = small_lm()
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


# ------------------------------------------------------------------------------------------------ every check
# Each record names the field that is wrong at the start of its message (records.py: "raises ValueError naming
# the field"); the patterns are anchored so that the field's name is what the message leads with.
def test_rollout_sample_refuses_each_bad_field_by_name():
    ok = dict(token_ids=[1, 2], text="t", num_forwards=1, tpf=2.0, num_edits=0, finished_by_eos=True)
    RolloutSample(**ok)
    RolloutSample(**{**ok, "num_forwards": 0, "num_edits": 0})  # zero is a count; only negative ones are refused
    for bad, pattern in [({"token_ids": (1, 2)}, r"^RolloutSample\.token_ids: expected a list of token ids$"),
                         ({"token_ids": [1, 2.0]}, r"^RolloutSample\.token_ids: expected a list of token ids$"),
                         ({"text": b"t"}, r"^RolloutSample\.text: expected a string, got bytes$"),
                         ({"num_forwards": -1}, r"^RolloutSample: negative counts \(num_forwards -1, num_edits 0\)$"),
                         ({"num_edits": -2}, r"^RolloutSample: negative counts \(num_forwards 1, num_edits -2\)$")]:
        with pytest.raises(ValueError, match=pattern):
            RolloutSample(**{**ok, **bad})
    with pytest.raises(ValueError, match=r"^RolloutSample: the rollout worker returned \['bogus', "):
        RolloutSample.from_worker({**ok, "bogus": 1})
    assert RolloutSample.from_worker(ok) == RolloutSample(**ok)
    assert RolloutSample(**ok).prompt_ids is None


def test_rollout_sample_trajectory_checks():
    traj = {"prompt_ids": [7, 8], "ids": [7, 8, 1, 2], "generated": [False, False, True, True],
            "segment": [0, 0, 1, 1], "turns": []}
    ok = dict(token_ids=[1, 2], text="t", num_forwards=1, tpf=2.0, num_edits=0, finished_by_eos=True)
    s = RolloutSample(**ok, trajectory=traj)
    assert s.prompt_ids == [7, 8] and s.prompt_ids is not traj["prompt_ids"]
    for key in ("prompt_ids", "ids", "generated", "segment", "turns"):
        with pytest.raises(ValueError, match=rf"^RolloutSample\.trajectory: missing \['{key}'\]$"):
            RolloutSample(**ok, trajectory={k: v for k, v in traj.items() if k != key})
    for key in ("generated", "segment"):
        short = {**traj, key: traj[key][:-1]}
        with pytest.raises(ValueError, match=r"^RolloutSample\.trajectory: ids, generated and segment differ in "
                                             r"length \(\d, \d, \d\)$"):
            RolloutSample(**ok, trajectory=short)
    with pytest.raises(ValueError, match=r"^RolloutSample\.token_ids: must be the trajectory's ids after its "):
        RolloutSample(**{**ok, "token_ids": [1, 3]}, trajectory=traj)


def _lb(B=2, L=5, **over):
    fields = dict(input_ids=torch.zeros(B, L, dtype=torch.long), prompt_lens=torch.ones(B, dtype=torch.long),
                  response_mask=torch.ones(B, L, dtype=torch.bool), advantages=torch.zeros(B))
    fields.update(over)
    return LearnerBatch(**fields)


def test_learner_batch_refuses_each_bad_field_by_name():
    assert _lb().num_rows == 2 and _lb(B=3).num_rows == 3
    with pytest.raises(ValueError, match=r"^LearnerBatch\.input_ids: expected \(B, L\), got \(5,\)$"):
        _lb(input_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^LearnerBatch\.input_ids: expected \(B, L\), got list$"):
        _lb(input_ids=[[1, 2]])
    with pytest.raises(ValueError, match=r"^LearnerBatch\.response_mask: expected shape \(2, 5\), got \(2, 4\)$"):
        _lb(response_mask=torch.ones(2, 4, dtype=torch.bool))
    for name in ("prompt_lens", "advantages", "response_lens", "group_ids", "weight_version"):
        with pytest.raises(ValueError, match=rf"^LearnerBatch\.{name}: expected shape \(2,\), got \(3,\)$"):
            _lb(**{name: torch.zeros(3, dtype=torch.long)})
        _lb(**{name: torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"^LearnerBatch\.lev_drafts: expected one list per row \(2\), got 1$"):
        _lb(lev_drafts=[[]])
    assert _lb(lev_drafts=[[], []]).lev_drafts == [[], []]


def test_learner_batch_from_mapping():
    from ebpo.core.likelihood import response_mask_from_ids

    ids = [[5, 6, 9, 1, 1], [5, 9, 9, 9, 1]]
    base = {"input_ids": ids, "prompt_lens": [2, 1], "advantages": [1, -1]}
    b = LearnerBatch.from_mapping(base, eos_id=1)
    assert b.input_ids.dtype == torch.long and b.advantages.dtype == torch.float32 and b.prompt_lens.dtype == torch.long
    assert torch.equal(b.response_mask, response_mask_from_ids(torch.tensor(ids), torch.tensor([2, 1]), 1))
    assert b.response_lens is None and b.group_ids is None and b.weight_version is None and b.lev_drafts is None
    given = LearnerBatch.from_mapping({**base, "response_mask": [[0, 0, 1, 0, 0], [0, 1, 1, 1, 1]], "group_ids": [0, 0],
                                       "weight_version": [3, 4], "response_lens": [1, 4], "lev_drafts": [[], []]}, 1)
    assert given.response_mask.dtype == torch.bool and given.response_mask.tolist()[0] == [False, False, True, False,
                                                                                          False]
    for k, v in (("group_ids", [0, 0]), ("weight_version", [3, 4]), ("response_lens", [1, 4])):
        assert getattr(given, k).dtype == torch.long and getattr(given, k).tolist() == v
    assert given.lev_drafts == [[], []]
    for key in ("input_ids", "prompt_lens", "advantages"):
        with pytest.raises(ValueError, match=rf"^batch: missing field '{key}' \(have \["):
            LearnerBatch.from_mapping({k: v for k, v in base.items() if k != key}, 1)
    with pytest.raises(ValueError, match=r"^batch: unknown fields \['extra'\]; allowed \["):
        LearnerBatch.from_mapping({**base, "extra": 1}, 1)
    with pytest.raises(ValueError, match=r"^batch\.input_ids: expected \(B, L\), got \(5,\)$"):
        LearnerBatch.from_mapping({**base, "input_ids": ids[0]}, 1)
    for key in ("prompt_lens", "advantages"):
        with pytest.raises(ValueError, match=rf"^batch\.{key}: expected shape \(2,\), got \(3,\)$"):
            LearnerBatch.from_mapping({**base, key: [1, 1, 1]}, 1)
    with pytest.raises(ValueError, match=r"^batch\.response_mask: expected shape \(2, 5\), got \(2, 4\)$"):
        LearnerBatch.from_mapping({**base, "response_mask": [[1] * 4] * 2}, 1)


def test_build_learner_batch_fields_and_tails():
    b = build_learner_batch([[5, 6], [7]], [[9, 1], [8, 8, 1]], torch.tensor([1, -1]), torch.tensor([0, 1]),
                            pad_id=3, tail_ids=[[1, 1], []], weight_version=[2, 5], lev_drafts=[[(0, [1])], []])
    assert b.input_ids.dtype == torch.long and b.input_ids.tolist() == [[5, 6, 9, 1, 1, 1], [7, 8, 8, 1, 3, 3]]
    assert b.response_mask.tolist() == [[False, False, True, True, True, True], [False, True, True, True, False, False]]
    assert b.response_lens.tolist() == [2, 3] and b.prompt_lens.tolist() == [2, 1]
    assert b.advantages.dtype == torch.float32 and b.group_ids.dtype == torch.long
    assert b.weight_version.dtype == torch.long and b.weight_version.tolist() == [2, 5]
    assert b.lev_drafts == [[(0, [1])], []]
    plain = build_learner_batch([[5]], [[]], torch.tensor([0.5]), torch.tensor([0]), pad_id=3)
    assert plain.weight_version is None and plain.input_ids.tolist() == [[5]] and not plain.response_mask.any()
    with pytest.raises(ValueError, match=r"^tail_ids: 1 tails for 2 responses$"):
        build_learner_batch([[5], [6]], [[1], [1]], torch.zeros(2), torch.zeros(2), pad_id=3, tail_ids=[[1]])


def test_build_learner_batch_multi_turn_rows():
    K = 2
    prompts, responses = [[5, 6], [7, 7]], [[8, 9, 4, 4], [8, 1]]
    turns = [([False, False, True, True, False, False], [0, 0, 1, 1, 2, 2]), None]
    b = build_learner_batch(prompts, responses, torch.zeros(2), torch.zeros(2), pad_id=3, turns=turns, block_size=K)
    assert b.response_mask.tolist() == [[False, False, True, True, False, False],  # only what the model wrote
                                        [False, False, True, True, False, False]]  # single-turn row as usual
    with pytest.raises(ValueError, match=r"^build_learner_batch: multi-turn rows need block_size$"):
        build_learner_batch(prompts, responses, torch.zeros(2), torch.zeros(2), pad_id=3, turns=turns)
    for bad in ((turns[0][0][:-1], turns[0][1]), (turns[0][0], turns[0][1][:-1])):
        with pytest.raises(ValueError, match=r"^build_learner_batch: row 0: generated/segment cover \d/\d tokens, "
                                             r"the row has 6$"):
            build_learner_batch(prompts, responses, torch.zeros(2), torch.zeros(2), pad_id=3, turns=[bad, None],
                                block_size=K)
    leaking = [([False, False, True, False, False, False], [0, 0, 1, 2, 2, 2]), None]
    with pytest.raises(ValueError, match="later segment"):
        build_learner_batch(prompts, responses, torch.zeros(2), torch.zeros(2), pad_id=3, turns=leaking, block_size=K)
    # the padding of a shorter multi-turn row is nobody's segment: it neither leaks nor is scored
    short = build_learner_batch([[5, 6], [7]], [[8, 9], [8, 1, 1, 1, 1]], torch.zeros(2), torch.zeros(2), pad_id=3,
                                turns=[([False, False, True, True], [0, 0, 1, 1]), None], block_size=K)
    assert short.response_mask[0].tolist() == [False, False, True, True, False, False]
