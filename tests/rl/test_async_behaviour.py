"""Behaviour-policy composites for asynchronous RL (ebpo.rl.async_behaviour) through the learner.

* Decoupled off-policy updates: a frozen policy gives importance weights of exactly 1, a moving one does not;
  every batch of versions outside c - s .. c (newer than the learner's weights as well as too old) is refused;
  a synchronous learner ignores weight versions bit for bit; two learner ranks give the importance weights of one.
* Block-exact behaviour terms for partial rollouts (`LearnerBatch.block_versions`): a row decoded under several
  weight versions (switched at block boundaries) gets the behaviour composite sum_b (block b's term under the
  version that decoded block b). Checked against a plain per-block loop: each version's weights loaded into a
  fresh model, per-block terms on the learner's own noise draws, picked per block, summed. Also: one version per
  row is today's update bit for bit, a frozen policy gives importance weights of exactly 1, multi-turn and
  Levenshtein rows, and the refusals of bad inputs."""
import copy
import itertools

import pytest
import torch

import ebpo.rl.learner as learner_mod
from ebpo.core.likelihood import all_composites
from ebpo.rl.async_behaviour import BehaviourSnapshots, check_block_versions, check_versions, split_rows
from ebpo.rl.learner import EBPOLearner, LearnerConfig
from ebpo.rl.records import LearnerBatch, build_learner_batch
from tests.support.models import small_lm

K = 4  # the tiny model's block size
EPS = torch.finfo(torch.float32).eps


def _batch(model, seed, versions, block_versions=None):
    """4 rows of prompt 5 + response 11 (EOS at 15) + padding to 20: blocks 1-3 hold response tokens, block 0 is
    prompt only and block 4 padding (version -1)."""
    g = torch.Generator().manual_seed(seed)
    eos, B = model.config.eos_token_id, len(versions)
    ids = torch.randint(3, eos + 100, (B, 20), generator=g)
    ids[:, 15:] = eos
    out = {"input_ids": ids, "prompt_lens": torch.full((B,), 5), "advantages": torch.randn(B, generator=g),
           "weight_version": torch.tensor(versions)}
    if block_versions is not None:
        out["block_versions"] = torch.tensor(block_versions)
    return out


def _uniform(versions):
    """Block versions of `_batch` rows decoded under one version each."""
    return [[-1, v, v, v, -1] for v in versions]


# update 2 (learner at version 2, s = 2): a 3-version split, a 2-version split at block 2, fresh, stale
SPLIT = [[-1, 0, 1, 2, -1], [-1, 1, 2, 2, -1], [-1, 2, 2, 2, -1], [-1, 1, 1, 1, -1]]


class Spy:
    """Records the noise of `prepare_behaviour` and every (rows, prox, behaviour) the loss receives.

    `prepare_behaviour` runs under a `meta` default device: a tensor it made without the learner's device would
    land on `meta` and fail (or give no numbers) where it meets the learner's CPU tensors, so every test that
    compares the spied values with a reference also checks that they were computed on the learner's device."""

    def __init__(self, monkeypatch):
        self.noise, self.calls = None, []
        prepare, of_rows = learner_mod.prepare_behaviour, learner_mod.behaviour_of_rows

        def spy_prepare(learner, wv, ids, noise, *args, **kwargs):
            self.noise = noise
            with torch.device("meta"):
                return prepare(learner, wv, ids, noise, *args, **kwargs)

        def spy_rows(behaviour, rows, prox):
            out = of_rows(behaviour, rows, prox)
            self.calls.append((rows.clone(), prox.detach().clone(), out.detach().clone()))
            return out

        monkeypatch.setattr(learner_mod, "prepare_behaviour", spy_prepare)
        monkeypatch.setattr(learner_mod, "behaviour_of_rows", spy_rows)


def _run(monkeypatch, fields, batches, lr=0.05, model_fn=small_lm, s=2):
    """A learner over `batches` (dicts); returns (learner, spy of the last update, weights of each version,
    metrics of the last update)."""
    learner = EBPOLearner(model_fn(), LearnerConfig(lr=lr, n_draws=2, seed=0, max_staleness=s, **fields))
    states = {}
    for i, batch in enumerate(batches):
        states[learner.updates_done] = copy.deepcopy(learner.model.state_dict())
        spy = Spy(monkeypatch) if i == len(batches) - 1 else None
        metrics = learner.update(batch)
    return learner, spy, states, metrics


def _reference(states, model_fn, batch, block_versions, noise, cfg):
    """Plain per-block loop: (B, N) sum over blocks b of b's term under the weights of block_versions[i][b],
    and the magnitude sum_b sum_v |term_v[b]| of every value used (for the tolerance)."""
    ids = torch.as_tensor(batch["input_ids"])
    terms = {}
    for v, state in states.items():
        model = model_fn()
        model.load_state_dict(state)
        model.train()  # as the learner's model
        with torch.no_grad():
            _, terms[v] = all_composites(model, ids, noise, model.config.mask_token_id, packed=cfg.packed,
                                         return_blocks=True)
    B, N, nb = terms[0].shape
    ref, mag = torch.zeros(B, N), torch.zeros(B, N)
    for i in range(B):
        for b in range(nb):
            v = block_versions[i][b] if b < len(block_versions[i]) else -1
            for u in terms:
                mag[i] += terms[u][i, :, b].abs()
            if v >= 0:
                ref[i] += terms[v][i, :, b]
            else:  # an undecoded block carries no term under any policy
                assert all(float(terms[u][i, :, b].abs().max()) == 0.0 for u in terms)
    return ref, mag, nb


def _tolerance(mag, nb, model):
    """|learner - reference| bound: the learner's micro-batch forward and the reference's whole-batch one differ
    only in rounding; a log-prob from reductions over at most `hidden` terms (and a softmax over the
    vocabulary) is accurate to ~(hidden + log V) eps of its magnitude, and the delta form adds 2 nb + 1 terms."""
    H = model.config.hidden_size
    return 4 * EPS * (H + 2 * nb + 1 + float(torch.log(torch.tensor(float(model.config.vocab_size))))) * mag


def _behaviour_by_row(spy, B):
    """The behaviour composite (B, N) the loss received for each row (first occurrence) and the proximal one."""
    behav, prox = [None] * B, [None] * B
    for rows, p, out in spy.calls:
        for j, r in enumerate(rows.tolist()):
            if behav[r] is None:
                behav[r], prox[r] = out[j], p[j]
    return torch.stack(behav), torch.stack(prox)


CONFIGS = [{"mu": 1}, {"mu": 2, "minibatch_size": 2, "max_tokens_per_microbatch": 24}]


def _three_updates(model):
    return [_batch(model, 0, [0, 0, 0, 0]), _batch(model, 1, [0, 1, 1, 0]),
            _batch(model, 2, [0, 1, 2, 1], block_versions=SPLIT)]


@pytest.mark.parametrize("fields", CONFIGS)
def test_split_rows_get_the_per_block_composite_of_their_versions(monkeypatch, fields):
    model = small_lm()
    batches = _three_updates(model)
    learner, spy, states, _ = _run(monkeypatch, fields, batches)
    behav, prox = _behaviour_by_row(spy, 4)
    ref, mag, nb = _reference(states, small_lm, batches[-1], SPLIT, spy.noise, learner.cfg)
    tol = _tolerance(mag, nb, model)
    assert bool(((behav - ref).abs() <= tol).all()), (behav - ref).abs().max()
    # not a vacuous check: the split rows' behaviour is far from the proximal (current) composite
    assert bool(((prox[:2] - ref[:2]).abs() > 10 * tol[:2]).all())
    assert torch.equal(behav[2], prox[2])  # the fresh row: weight exactly 1


@pytest.mark.parametrize("fields", CONFIGS)
def test_frozen_policy_gives_split_rows_a_weight_of_exactly_one(monkeypatch, fields):
    model = small_lm()
    _, spy, _, m = _run(monkeypatch, fields, _three_updates(model), lr=0.0)
    assert m["actor/is_weight_min"] == 1.0 and m["actor/is_weight_max"] == 1.0, m
    assert m["actor/behav_log_ratio_mean"] == 0.0 and m["actor/is_truncated_frac"] == 0.0
    behav, prox = _behaviour_by_row(spy, 4)
    assert torch.equal(behav, prox)


def test_one_version_per_row_is_todays_update_bit_for_bit():
    runs = []
    for with_blocks in (False, True):
        model = small_lm()
        learner = EBPOLearner(model, LearnerConfig(lr=0.05, n_draws=2, seed=0, max_staleness=2, mu=2,
                                                   minibatch_size=2))
        metrics = []
        for seed, v in enumerate([[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 2, 2]]):
            metrics.append(learner.update(_batch(model, seed, v, _uniform(v) if with_blocks else None)))
        runs.append(([{k: x for k, x in m.items() if not k.startswith("timing_s/")} for m in metrics],
                     [p.detach().clone() for p in learner.model.parameters()]))
    (ma, wa), (mb, wb) = runs
    assert ma == mb
    assert all(torch.equal(p, q) for p, q in zip(wa, wb))
    assert ma[2]["actor/behav_log_ratio_mean"] != 0.0  # stale rows were there to be weighted


def _trajectory_row(prompt, turns):
    """(ids, generated, segment) of a multi-turn row: `turns` = [(model ids, observation ids or None)]."""
    ids, gen, seg = list(prompt), [False] * len(prompt), [0] * len(prompt)
    for t, (model_ids, obs) in enumerate(turns):
        ids += model_ids
        gen += [True] * len(model_ids)
        seg += [2 * t + 1] * len(model_ids)
        if obs:
            ids += obs
            gen += [False] * len(obs)
            seg += [2 * t + 2] * len(obs)
    return ids, gen, seg


def test_multi_turn_rows_split_across_versions_match_the_per_block_loop(monkeypatch):
    # prompt of 6 (turn 1 ends block 1), a 5-token observation (block 2 observation only), turn 2 from position
    # 13 (blocks 3-4), decoded after the weights moved: blocks [-1, 0, -1, 1, 1]
    model = small_lm()
    ids, gen, seg = _trajectory_row([4, 5, 6, 7, 8, 9], [([20, 21], [50, 51, 52, 53, 54]),
                                                          ([22, 23, 24, 25, 26, 1], None)])
    prompts = [ids[:6], [4, 5, 6]]
    responses = [ids[6:], [30, 31, 32, 33, 1]]
    bv = [[-1, 0, -1, 1, 1], [0, 1]]  # the single-turn row: block 0 under version 0, block 1 under 1
    batch = build_learner_batch(prompts, responses, torch.tensor([1.0, -1.0]), torch.arange(2), pad_id=1,
                                turns=[(gen, seg), None], block_size=K, block_versions=bv)
    assert batch.block_versions.tolist() == [[-1, 0, -1, 1, 1], [0, 1, -1, -1, -1]]
    assert batch.weight_version.tolist() == [0, 0]  # derived: the oldest decoded block
    first = _batch(model, 0, [0, 0])
    learner, spy, states, _ = _run(monkeypatch, {"mu": 2}, [first, batch], s=1)
    behav, prox = _behaviour_by_row(spy, 2)
    ref, mag, nb = _reference(states, small_lm, {"input_ids": batch.input_ids}, batch.block_versions.tolist(),
                              spy.noise, learner.cfg)
    tol = _tolerance(mag, nb, model)
    assert bool(((behav - ref).abs() <= tol).all()), (behav - ref).abs().max()
    assert bool(((prox - ref).abs() > 10 * tol).all())


DEL, INS, MASK = 105, 106, 2


def _lev_model():
    m = small_lm()
    m.config.delete_token_id, m.config.insert_token_id = DEL, INS
    return m


def test_levenshtein_rows_split_across_versions_match_the_per_block_loop(monkeypatch):
    # the rows and pre-edit drafts of tests/levenshtein/test_lev_ebpo.py (L = 10: blocks 0-3, 4-7, 8-9)
    ids = torch.tensor([[5, 6, 7, 20, 21, 22, 23, 24, 25, 1],
                        [8, 9, 10, 11, 12, 30, 31, 32, 33, 34],
                        [13, 14, 40, 41, 42, 43, 44, 45, 46, 47]])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    for i, p in enumerate([3, 5, 2]):
        resp[i, p:] = True
    drafts = [[(1, [22, 22, 23, 24])], [(3, [33, 35, 36, MASK]), (-1, [12, 30, 30, 31])], []]
    bv = [[0, 1, 1], [-1, 0, 1], [1, 1, 1]]
    batch = {"input_ids": ids, "prompt_lens": torch.tensor([3, 5, 2]), "response_mask": resp,
             "advantages": torch.tensor([1.0, -0.5, 0.3]), "lev_drafts": drafts, "block_versions": bv}
    first = {k: v for k, v in batch.items() if k not in ("block_versions", "lev_drafts")}
    learner, spy, states, _ = _run(monkeypatch, {"mu": 2, "levenshtein": True}, [first, batch], model_fn=_lev_model,
                                s=1)
    plain = torch.where(spy.noise.masked, MASK, ids[None])  # EBPO's noisy input: the drafts really enter
    assert spy.noise.noisy_ids is not None and not torch.equal(spy.noise.noisy_ids, plain)
    behav, prox = _behaviour_by_row(spy, 3)
    ref, mag, nb = _reference(states, _lev_model, batch, bv, spy.noise, learner.cfg)
    tol = _tolerance(mag, nb, learner.model)
    assert bool(((behav - ref).abs() <= tol).all()), (behav - ref).abs().max()
    assert bool(((prox[:2] - ref[:2]).abs() > 10 * tol[:2]).all())


def _lb(**fields):
    base = dict(input_ids=torch.zeros(2, 12, dtype=torch.long), prompt_lens=torch.tensor([2, 3]),
                response_mask=torch.zeros(2, 12, dtype=torch.bool), advantages=torch.zeros(2))
    return LearnerBatch(**{**base, **fields})


def test_learner_batch_checks_block_versions():
    with pytest.raises(ValueError, match=r"^LearnerBatch\.block_versions: expected shape \(2, nb\), got \(3, 3\)$"):
        _lb(block_versions=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^LearnerBatch\.block_versions: expected shape \(2, nb\), got \(2,\)$"):
        _lb(block_versions=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^LearnerBatch\.block_versions: expected dtype torch\.int64, got torch\.float32$"):
        _lb(block_versions=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"-1 for an undecoded block; got -2$"):
        _lb(block_versions=torch.tensor([[0, -2, 1], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"^LearnerBatch\.weight_version: row 1 has version 2 but its oldest decoded "
                                         r"block is version 1"):
        _lb(block_versions=torch.tensor([[-1, 1, 2], [-1, 1, 2]]), weight_version=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"row 1 has no decoded block; give weight_version$"):
        _lb(block_versions=torch.tensor([[-1, 1, 2], [-1, -1, -1]]))
    b = _lb(block_versions=torch.tensor([[-1, 3, 2], [-1, -1, -1]]), weight_version=torch.tensor([2, 5]))
    assert b.weight_version.tolist() == [2, 5]  # checked; a row with no decoded block keeps its own
    assert _lb(block_versions=torch.tensor([[-1, 3, 2], [4, 4, -1]])).weight_version.tolist() == [2, 4]  # derived
    m = LearnerBatch.from_mapping({"input_ids": [[5] * 12] * 2, "prompt_lens": [2, 3], "advantages": [0.0, 0.0],
                                   "block_versions": [[-1, 1], [0, 0, 1]]}, eos_id=1)
    assert m.block_versions.tolist() == [[-1, 1, -1], [0, 0, 1]] and m.weight_version.tolist() == [1, 0]
    with pytest.raises(ValueError, match="block_versions need block_size"):
        build_learner_batch([[1, 2]], [[3, 4]], torch.zeros(1), torch.zeros(1), pad_id=0, block_versions=[[0]])
    with pytest.raises(ValueError, match=r"^block_versions: row 0 has a version for block 2, past the batch's 2 blocks$"):
        build_learner_batch([[1, 2]], [[3, 4]], torch.zeros(1), torch.zeros(1), pad_id=0, block_size=2,
                            block_versions=[[-1, 0, 1]])
    ok = build_learner_batch([[1, 2]], [[3, 4]], torch.zeros(1), torch.zeros(1), pad_id=0, block_size=2,
                             block_versions=[[-1, 0, -1]])
    assert ok.block_versions.tolist() == [[-1, 0]] and ok.weight_version.tolist() == [0]
    # an empty list: the row was decoded under its weight_version alone (its blocks with scored tokens get it)
    mixed = build_learner_batch([[1, 2, 3], [1]], [[4, 5, 6], [7]], torch.zeros(2), torch.zeros(2), pad_id=0,
                                block_size=2, block_versions=[[], [0, -1, -1]], weight_version=[3, 0])
    assert mixed.block_versions.tolist() == [[-1, 3, 3], [0, -1, -1]]
    with pytest.raises(ValueError, match="row 0 has no block_versions; give weight_version"):
        build_learner_batch([[1, 2, 3]], [[4]], torch.zeros(1), torch.zeros(1), pad_id=0, block_size=2,
                            block_versions=[[]])


def test_learner_refuses_bad_block_versions():
    model = small_lm()
    learner = EBPOLearner(model, LearnerConfig(lr=0.01, n_draws=2, seed=0, max_staleness=1))
    learner.update(_batch(model, 0, [0, 0]))
    learner.update(_batch(model, 1, [0, 1]))  # learner now at version 2, s = 1: versions 1..2 allowed
    cases = [([[-1, 1, 2, 3, -1], [-1, 2, 2, 2, -1]], r"row 0 block 3: version 3 is newer than the learner's "
                                                        r"version 2"),
             ([[-1, 0, 1, 2, -1], [-1, 2, 2, 2, -1]], r"row 0 block 1: version 0 is more than learner\.max_staleness "
                                                        r"= 1 versions behind"),
             ([[-1, 1, -1, 2, -1], [-1, 2, 2, 2, -1]], r"row 0 block 2: version -1 holds scored tokens but no version"),
             ([[-1, 1, 2, 2, -1, 2], [-1, 2, 2, 2, -1, -1]], r"row 0 has a version for block 5, past the batch's 5 "
                                                               r"blocks")]
    for bv, msg in cases:
        wv = [min(v for v in row if v >= 0) for row in bv]
        with pytest.raises(ValueError, match=r"^batch\.block_versions: " + msg):
            learner.update(_batch(model, 2, wv, bv))
    assert learner.updates_done == 2
    short = [[-1, 1, 2, 2], [-1, 2, 2, 2]]  # missing trailing columns read as -1 (block 4 is padding)
    m = learner.update(_batch(model, 2, [1, 2], short))
    assert m["actor/is_weight_max"] >= m["actor/is_weight_min"] > 0


def _versioned_batch(model, seed, versions, block_versions=None):
    g = torch.Generator().manual_seed(seed)
    eos, B = model.config.eos_token_id, len(versions)
    ids = torch.randint(0, eos, (B, 20), generator=g)
    ids[:, 15:] = eos
    out = {"input_ids": ids, "prompt_lens": torch.full((B,), 5), "advantages": torch.randn(B, generator=g),
           "weight_version": torch.tensor(versions)}
    if block_versions is not None:
        out["block_versions"] = torch.tensor(block_versions)
    return out


@pytest.mark.parametrize("fields", [{"mu": 1}, {"mu": 2, "minibatch_size": 2, "grad_replay": True}])
def test_frozen_policy_gives_importance_weights_of_exactly_one(fields):
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    def run(lr):
        model = small_lm()
        learner = EBPOLearner(model, LearnerConfig(lr=lr, n_draws=2, seed=0, max_staleness=2, **fields))
        out = [learner.update(_versioned_batch(model, 0, [0, 0, 0, 0]))]
        out.append(learner.update(_versioned_batch(model, 1, [0, 1, 0, 1])))  # half the rows one version behind
        out.append(learner.update(_versioned_batch(model, 2, [0, 1, 2, 2])))  # two behind, one behind, fresh
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
    learner.update(_versioned_batch(model, 0, [0, 0]))
    learner.update(_versioned_batch(model, 1, [0, 1]))
    with pytest.raises(ValueError, match="weight_version"):
        learner.update(_versioned_batch(model, 2, [0, 2]))  # learner at 2, s = 1: version 0 is two behind
    with pytest.raises(ValueError, match="max_staleness"):
        LearnerConfig(max_staleness=-1).validate()


def test_synchronous_learner_ignores_weight_versions_bit_for_bit():
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    a_model, b_model = small_lm(), small_lm()
    a = EBPOLearner(a_model, LearnerConfig(lr=0.01, n_draws=2, seed=0))
    b = EBPOLearner(b_model, LearnerConfig(lr=0.01, n_draws=2, seed=0))
    batch = _versioned_batch(a_model, 0, [0, 0, 0])
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
    # the last batch: row 0 split across versions 1 and 2 (on rank 0 of two), the others one version each
    split = [[-1, 1, 2, 2, -1], [-1, 2, 2, 2, -1], [-1, 1, 1, 1, -1], [-1, 2, 2, 2, -1]]
    metrics = [learner.update(_versioned_batch(model, i, v, bv))
               for i, (v, bv) in enumerate([([0] * 4, None), ([0, 1, 0, 1], None), ([1, 2, 1, 2], split)])]
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
    model = small_lm()
    learner = EBPOLearner(model, LearnerConfig(lr=0.01, n_draws=2, seed=0, max_staleness=2))
    learner.update(_versioned_batch(model, 0, [0, 0]))  # the learner is at version 1 now
    for versions in ([1, 2], [2, 2], [0, 5]):
        with pytest.raises(ValueError, match="weight_version"):
            learner.update(_versioned_batch(model, 1, versions))
    learner.update(_versioned_batch(model, 1, [0, 1]))  # in range: accepted


def test_the_refusals_name_the_allowed_range_and_the_first_bad_block():
    with pytest.raises(ValueError, match=r"^batch\.weight_version: versions 1\.\.4 outside 2\.\.4 \(learner at version 4, "
                                         r"learner\.max_staleness = 2\)$"):
        check_versions(torch.tensor([4, 1]), 4, 2)
    scored = torch.zeros(2, 10, dtype=torch.bool)  # 3 blocks of 4 (the last one short)
    scored[:, 4:9] = True
    with pytest.raises(ValueError, match=r"^batch\.block_versions: row 1 has a version for block 4, past the batch's 3 "
                                         r"blocks of 4 tokens$"):
        check_block_versions(torch.tensor([[-1, 3, 3, -1, -1], [-1, 3, 3, -1, 2]]), scored, 4, 3, 1)
    with pytest.raises(ValueError, match=r"row 0 has a version for block 3, past"):  # version 0 is a version too
        check_block_versions(torch.tensor([[-1, 0, 0, 0], [-1, 0, 0, -1]]), scored, 4, 0, 0)


def test_missing_trailing_block_versions_read_as_undecoded():
    scored = torch.zeros(2, 12, dtype=torch.bool)
    scored[:, 4:8] = True  # only block 1 holds scored positions
    bv = check_block_versions(torch.tensor([[-1, 3], [-1, 2]]), scored, 4, 3, 1)
    assert bv.tolist() == [[-1, 3, -1], [-1, 2, -1]] and bv.dtype == torch.long
    # a version that would be refused (3 behind) is not invented for the missing column
    assert check_block_versions(torch.tensor([[-1, 5]]), scored[:1], 4, 5, 0).tolist() == [[-1, 5, -1]]


def test_split_rows_are_the_rows_with_two_decoded_versions():
    bv = torch.tensor([[-1, 2, 2, -1], [1, 1, -1, -1], [0, 1, -1, 2], [-1, -1, -1, -1], [3, -1, 3, 3]])
    assert split_rows(bv).tolist() == [False, False, True, False, False]
    assert split_rows(torch.tensor([[-1, -1], [0, 0]])).tolist() == [False, False]


def test_snapshots_keep_s_versions_on_the_cpu_and_round_trip():
    model = small_lm()
    none = BehaviourSnapshots(0)  # a synchronous learner keeps no copy
    none.record(model, 0)
    assert none.versions == {}
    snaps = BehaviourSnapshots(2)
    for v in range(4):
        snaps.record(model, v)
        snaps.prune(v + 1)
    assert sorted(snaps.versions) == [2, 3]
    w = snaps.get(3)
    assert all(x.device.type == "cpu" for x in w.values())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(w[next(iter(model.state_dict()))], next(iter(model.state_dict().values())))  # a copy
    with pytest.raises(KeyError, match=r"behaviour weights of version 1 are not kept \(kept: \[2, 3\]; "
                                       r"learner\.max_staleness = 2\)"):
        snaps.get(1)
    again = BehaviourSnapshots(2)
    again.restore(snaps.state())
    assert snaps.state()["keep"] == 2 and sorted(again.versions) == [2, 3] and again.versions is not snaps.versions
    assert all(torch.equal(again.get(3)[k], w[k]) for k in w)


def test_without_weight_versions_every_row_is_fresh_and_split_rows_cost_no_whole_row_pass(monkeypatch):
    """prepare_behaviour returns (behav (B, N), stale (B,), split); a split row's behaviour comes from its block
    deltas alone, so a batch whose only stale rows are split runs no whole-row pass under an old version."""
    prepare, seen = learner_mod.prepare_behaviour, []

    def spy(learner, *args, **kwargs):
        composites = learner.composites
        kinds = []
        learner.composites = lambda *a, **k: kinds.append(k.get("blocks", False)) or composites(*a, **k)
        try:
            out = prepare(learner, *args, **kwargs)
        finally:
            learner.composites = composites
        seen.append((out, kinds))
        return out

    monkeypatch.setattr(learner_mod, "prepare_behaviour", spy)
    model = small_lm()
    learner = EBPOLearner(model, LearnerConfig(lr=0.05, n_draws=2, seed=0, max_staleness=1))
    batch = _batch(model, 0, [0, 0, 0])
    del batch["weight_version"]
    learner.update(batch)
    (behav, stale, split), _ = seen[-1]
    assert behav.shape == (3, 2) and stale.tolist() == [False] * 3 and split is None
    learner.update(_batch(model, 1, [0, 1, 1], block_versions=[[-1, 0, 1, 1, -1]] + _uniform([1, 1])))
    (_, stale, split), kinds = seen[-1]
    assert stale.tolist() == [True, False, False] and split.tolist() == [True, False, False]
    assert kinds and all(kinds)  # block passes only (live, then version 0)


def test_split_rows_of_a_batch_with_more_rows_than_positions(monkeypatch):
    """B = 10 rows of L = 8 positions (two blocks; row 0 split across versions 0 and 1): the per-block terms are
    kept per row, whatever B and L are, and match the per-block loop."""
    model = small_lm()
    g = torch.Generator().manual_seed(3)
    eos = model.config.eos_token_id

    def batch(versions, bv=None):
        ids = torch.randint(3, 100, (10, 8), generator=g)
        ids[:, 7] = eos
        out = {"input_ids": ids, "prompt_lens": torch.full((10,), 3), "advantages": torch.randn(10, generator=g),
               "weight_version": torch.tensor(versions)}
        if bv is not None:
            out["block_versions"] = torch.tensor(bv)
        return out

    bv = [[0, 1]] + [[1, 1]] * 9
    last = batch([0] + [1] * 9, bv)
    learner, spy, states, _ = _run(monkeypatch, {"mu": 1}, [batch([0] * 10), last], s=1)
    behav, prox = _behaviour_by_row(spy, 10)
    ref, mag, nb = _reference(states, small_lm, last, bv, spy.noise, learner.cfg)
    tol = _tolerance(mag, nb, model)
    assert bool(((behav - ref).abs() <= tol).all()), (behav - ref).abs().max()
    assert bool(((prox[0] - ref[0]).abs() > 10 * tol[0]).all())  # row 0's behaviour is not the proximal one
