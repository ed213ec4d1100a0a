"""The decoupled off-policy EBPO loss (ebpo.core.offpolicy) against a plain per-sequence reference, and the
learner's behaviour composites: a frozen policy gives importance weights of exactly 1, a moving one does not."""
import copy
import math

import pytest
import torch

from ebpo.core.algos import ebpo_loss
from ebpo.core.offpolicy import decoupled_ebpo_loss, truncated_importance_weights
from tests.support.models import small_lm


def _reference(cur, prox, behav, adv, eps_low, eps_high, cap, dual_clip=None):
    """The decoupled objective written out one sequence at a time, in probability space."""
    total = 0.0
    for i in range(cur.shape[0]):
        rho = math.exp(float((cur[i] - prox[i]).mean()))
        w = min(math.exp(float((prox[i] - behav[i]).mean())), cap)
        a = float(adv[i])
        obj = min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
        if dual_clip is not None and a < 0:
            obj = max(obj, dual_clip * a)
        total += w * obj
    return -total / cur.shape[0]


def test_decoupled_loss_matches_a_plain_reference_and_truncates():
    g = torch.Generator().manual_seed(0)
    B, N = 12, 3
    prox = torch.randn(B, N, generator=g) * 5 - 20
    behav = prox + torch.randn(B, N, generator=g) * 0.6  # some ratios above the cap
    cur = prox + torch.randn(B, N, generator=g) * 0.2
    adv = torch.randn(B, generator=g)
    for dual in (None, 3.0):
        loss, m = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=1.5, dual_clip=dual)
        assert float(loss) == pytest.approx(_reference(cur, prox, behav, adv, 0.2, 0.28, 1.5, dual), rel=1e-5)
    w, trunc = truncated_importance_weights(prox, behav, 1.5)
    lw = (prox - behav).mean(1)
    assert torch.equal(trunc, lw > math.log(1.5)) and 0 < int(trunc.sum()) < B
    assert float(w.max()) == pytest.approx(1.5) and m["is_truncated_frac"] == pytest.approx(float(trunc.float().mean()))
    assert m["is_weight_max"] == pytest.approx(1.5)


def test_weights_carry_no_gradient_and_scale_each_sequence():
    g = torch.Generator().manual_seed(1)
    prox = torch.randn(4, 2, generator=g)
    behav = prox - torch.tensor([[0.1], [0.0], [-0.2], [0.3]])
    cur = prox.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    loss, _ = decoupled_ebpo_loss(cur, prox, behav, adv, 0.2, 0.28, cap=10.0)
    loss.backward()
    w = torch.exp((prox - behav).mean(1))
    # at cur == prox (ratio 1, inside the clip window) d loss / d cur[i, n] = -w_i A_i / (B N)
    expected = (-(w * adv) / (4 * 2))[:, None].expand(4, 2)
    assert torch.allclose(cur.grad, expected, atol=1e-6)


def test_behaviour_equal_to_proximal_is_the_on_policy_loss_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    prox = torch.randn(6, 2, generator=g)
    cur = prox + 0.1 * torch.randn(6, 2, generator=g)
    adv = torch.randn(6, generator=g)
    a, ma = ebpo_loss(cur, prox, adv, 0.2, 0.28, dual_clip=3.0)
    b, mb = decoupled_ebpo_loss(cur, prox, prox.clone(), adv, 0.2, 0.28, cap=2.0, dual_clip=3.0)
    assert torch.equal(a, b) and mb["is_weight_min"] == mb["is_weight_max"] == 1.0
    assert all(ma[k] == mb[k] for k in ma)


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
