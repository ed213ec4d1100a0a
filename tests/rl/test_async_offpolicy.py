"""The decoupled off-policy EBPO loss (ebpo.core.offpolicy) against a plain per-sequence reference, and the
learner's behaviour composites: a frozen policy gives importance weights of exactly 1, a moving one does not."""
import copy

import pytest
import torch

from tests.support.models import small_lm


def _batch(model, seed, versions):
    g = torch.Generator().manual_seed(seed)
    eos, B = model.config.eos_token_id, len(versions)
    ids = torch.randint(0, eos, (B, 20), generator=g)
    ids[:, 15:] = eos
    return {"input_ids": ids, "prompt_lens": torch.full((B,), 5), "advantages": torch.randn(B, generator=g),
            "weight_version": torch.tensor(versions)}


@pytest.mark.parametrize("fields", [{"mu": 1}, {"mu": 2, "minibatch_size": 2, "grad_replay": True}])
def test_frozen_policy_gives_importance_weights_of_exactly_one(fields):
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    def run(lr):
        model = small_lm()
        learner = EBPOLearner(model, LearnerConfig(lr=lr, n_draws=2, seed=0, max_staleness=2, **fields))
        out = [learner.update(_batch(model, 0, [0, 0, 0, 0]))]
        out.append(learner.update(_batch(model, 1, [0, 1, 0, 1])))  # half the rows one version behind
        out.append(learner.update(_batch(model, 2, [0, 1, 2, 2])))  # two behind, one behind, fresh
        assert sorted(learner.snapshots.versions) == [1, 2]  # versions 3 - s .. 2 are kept
        return out

    for m in run(0.0):
        assert m["actor/is_weight_min"] == 1.0 and m["actor/is_weight_max"] == 1.0, m
        assert m["actor/is_truncated_frac"] == 0.0 and m["actor/behav_log_ratio_mean"] == 0.0
    moving = run(0.05)
    assert moving[0]["actor/is_weight_max"] == 1.0  # nothing stale yet
    assert moving[1]["actor/is_weight_min"] != 1.0 or moving[1]["actor/is_weight_max"] != 1.0
    assert moving[2]["actor/behav_log_ratio_mean"] != 0.0


def test_versions_outside_the_staleness_bound_are_refused():
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    model = small_lm()
    learner = EBPOLearner(model, LearnerConfig(lr=0.01, n_draws=2, seed=0, max_staleness=1))
    learner.update(_batch(model, 0, [0, 0]))
    learner.update(_batch(model, 1, [0, 1]))
    with pytest.raises(ValueError, match="weight_version"):
        learner.update(_batch(model, 2, [0, 2]))  # learner at 2, s = 1: version 0 is two behind
    with pytest.raises(ValueError, match="max_staleness"):
        LearnerConfig(max_staleness=-1).validate()


def test_synchronous_learner_ignores_weight_versions_bit_for_bit():
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    a_model, b_model = small_lm(), small_lm()
    a = EBPOLearner(a_model, LearnerConfig(lr=0.01, n_draws=2, seed=0))
    b = EBPOLearner(b_model, LearnerConfig(lr=0.01, n_draws=2, seed=0))
    batch = _batch(a_model, 0, [0, 0, 0])
    plain = {k: v for k, v in batch.items() if k != "weight_version"}
    ma, mb = a.update(plain), b.update(copy.deepcopy(batch))
    assert {k: v for k, v in ma.items() if not k.startswith("timing")} == \
        {k: v for k, v in mb.items() if not k.startswith("timing")}
    assert all(torch.equal(p, q) for p, q in zip(a_model.parameters(), b_model.parameters()))


def _group_worker(rank, world, port, out_path):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    learner = EBPOLearner(small_lm(), LearnerConfig(num_workers=world, lr=0.01, n_draws=2, seed=0, max_staleness=1,
                                                  noise="bernoulli"))
    model = learner.get_model()
    metrics = [learner.update(_batch(model, i, v)) for i, v in enumerate([[0] * 4, [0, 1, 0, 1], [1, 2, 1, 2]])]
    if rank == 0:
        torch.save(metrics, out_path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def test_two_learner_ranks_give_the_same_importance_weights_as_one(tmp_path):
    import socket

    import torch.multiprocessing as mp

    out = {}
    for world in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_group_worker, args=(world, port, str(tmp_path / f"w{world}.pt")), nprocs=world, join=True)
        out[world] = torch.load(tmp_path / f"w{world}.pt", weights_only=False)
    for one, two in zip(out[1], out[2]):
        for k in ("actor/is_weight_mean", "actor/is_weight_max", "actor/behav_log_ratio_mean", "actor/pg_loss",
                  "actor/grad_norm"):
            assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    assert out[2][2]["actor/behav_log_ratio_mean"] != 0.0  # the stale rows were really scored by version 1


def test_max_staleness_is_checked_with_the_key_named(tmp_path):
    from ebpo.infra.config import ConfigError, load_config
    from ebpo.rl.config import RLConfig

    for bad in ("-1", "1.5", "true"):
        with pytest.raises((ConfigError, ValueError), match="trainer.max_staleness"):
            load_config(RLConfig, None, [f"trainer.max_staleness={bad}"])
    with pytest.raises(ConfigError, match="trainer.max_staleness"):
        load_config(RLConfig, None, ["trainer.max_staleness=2", "ray.weight_sync=broadcast"])
    assert load_config(RLConfig, None, ["trainer.max_staleness=2"]).learner.max_staleness == 2
    with pytest.raises(ConfigError, match="learner.max_staleness"):
        load_config(RLConfig, None, ["trainer.max_staleness=1", "learner={backend: deepspeed}"])
    # one owner: the learner's key conflicts with the trainer's, or is a deprecated alias of it
    with pytest.raises(ConfigError, match="set trainer.max_staleness only"):
        load_config(RLConfig, None, ["trainer.max_staleness=1", "learner.max_staleness=2"])
    with pytest.warns(DeprecationWarning, match="trainer.max_staleness"):
        cfg = load_config(RLConfig, None, ["learner.max_staleness=2"])
    assert cfg.trainer.max_staleness == 2 and cfg.learner.max_staleness == 2
