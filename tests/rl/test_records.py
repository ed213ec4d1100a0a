"""The records that cross between the RL roles (ebpo.rl.records), checked against their docstrings.

* `StepRecord` refuses a keep mask of any dtype but bool and a field of the wrong shape; `RolloutSample` and
  `LearnerBatch` refuse each bad field by name; `build_learner_batch`'s fields, tails and multi-turn rows;
* per-block weight versions (pad_block_versions, build_learner_batch's block_versions, LearnerBatch's checks):
  refusals with their exact messages, rows without a list in a batch of several, a version 0 past the batch's
  blocks, zero-column and zero-row batches;
* multi-turn samples without Ray: the learner batch scores exactly the model's tokens (checked against a plain
  loop over the trajectory), refuses a layout that would leak the future, and the rollout worker's multi-turn
  path returns records that hold together."""
import functools
import re

import pytest
import torch

from ebpo.rl.records import LearnerBatch, RolloutSample, StepRecord, build_learner_batch, pad_block_versions

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


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _fields(B=2, L=8):
    return dict(input_ids=torch.zeros(B, L, dtype=torch.long), prompt_lens=torch.full((B,), 2),
                response_mask=torch.ones(B, L, dtype=torch.bool), advantages=torch.zeros(B))


@pytest.mark.parametrize("bad, got", [([[0, 1], [1, 1]], "list"), ((0, 1), "tuple"),
                                      (torch.zeros(3, 2, dtype=torch.long), "(3, 2)"),
                                      (torch.zeros(2, dtype=torch.long), "(2,)")])
def test_learner_batch_refuses_block_versions_of_another_shape_naming_what_it_got(bad, got):
    with pytest.raises(ValueError, match=exact(f"LearnerBatch.block_versions: expected shape (2, nb), got {got}")):
        LearnerBatch(**_fields(), block_versions=bad)


def test_zero_block_columns_keep_the_given_weight_versions():
    """(B, 0): no row has a decoded block, so each keeps its given weight_version; without one it is refused."""
    b = LearnerBatch(**_fields(), weight_version=torch.tensor([3, 5]), block_versions=torch.zeros(2, 0, dtype=torch.long))
    assert b.weight_version.tolist() == [3, 5]
    with pytest.raises(ValueError, match="row 0 has no decoded block; give weight_version"):
        LearnerBatch(**_fields(), block_versions=torch.zeros(2, 0, dtype=torch.long))


def test_rows_without_a_list_get_their_weight_version_on_their_scored_blocks():
    """Several rows without block_versions in one batch: each row's blocks holding a scored position get that
    row's weight_version, the others -1 (a plain per-block loop over the response positions)."""
    K = 4
    prompts = [[1, 2, 3], [4] * 6, [5], [6, 7]]
    responses = [[9] * 6, [9] * 2, [9] * 11, [9] * 3]
    versions = [4, 7, 2, 9]
    lists = [[], None, [2, 3, 2], []]  # rows 0, 1, 3 without one (row 2: its oldest is its weight_version)
    b = build_learner_batch(prompts, responses, torch.zeros(4), torch.arange(4), pad_id=0, weight_version=versions,
                            block_size=K, block_versions=lists)
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    nb = -(-L // K)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if lists[i]:
            want = lists[i] + [-1] * (nb - len(lists[i]))
        else:
            scored_blocks = {j // K for j in range(len(p), len(p) + len(r))}
            want = [versions[i] if blk in scored_blocks else -1 for blk in range(nb)]
        assert b.block_versions[i].tolist() == want, i


def test_block_versions_need_a_block_size():
    with pytest.raises(ValueError, match=exact("build_learner_batch: block_versions need block_size")):
        build_learner_batch([[1]], [[2]], torch.zeros(1), torch.zeros(1), pad_id=0, weight_version=[0],
                            block_versions=[[0]])


def test_pad_block_versions_refusals_name_the_rows_and_the_block():
    with pytest.raises(ValueError, match=exact("block_versions: 1 lists for 2 rows")):
        pad_block_versions([[0]], 2, 3)
    for past_version in (0, 4):  # version 0 is a version like any other
        rows = [[0, 0], [1, 1, -1, -1, past_version, 2]]
        with pytest.raises(ValueError, match=exact("block_versions: row 1 has a version for block 4, past the "
                                                   "batch's 3 blocks")):
            pad_block_versions(rows, 2, 3)
    out = pad_block_versions([[0, 1], [2, -1, 3, -1, -1]], 2, 3)  # -1 past the batch is fine
    assert out.tolist() == [[0, 1, -1], [2, -1, 3]] and out.dtype == torch.long


def test_an_empty_mapping_batch_gets_empty_block_versions():
    """from_mapping with zero rows and an empty list of per-row lists: a (0, 0) block_versions."""
    b = LearnerBatch.from_mapping({"input_ids": torch.zeros(0, 4, dtype=torch.long), "prompt_lens": [],
                                   "advantages": [], "block_versions": []}, eos_id=1)
    assert tuple(b.block_versions.shape) == (0, 0) and b.block_versions.dtype == torch.long


K = 4


def trajectory(prompt, turns):
    """A plain-data trajectory: `turns` = [(model ids, observation ids or None)], model ids block-aligned."""
    ids, gen, seg = list(prompt), [False] * len(prompt), [0] * len(prompt)
    for t, (model, obs) in enumerate(turns):
        ids += model
        gen += [True] * len(model)
        seg += [2 * t + 1] * len(model)
        if obs:
            ids += obs
            gen += [False] * len(obs)
            seg += [2 * t + 2] * len(obs)
    return {"prompt_ids": list(prompt), "ids": ids, "generated": gen, "segment": seg, "turns": []}


def sample_of(traj):
    return RolloutSample(token_ids=traj["ids"][len(traj["prompt_ids"]):], text="", num_forwards=1, tpf=1.0,
                         num_edits=0, finished_by_eos=True, trajectory=traj)


def test_learner_batch_scores_only_generated_tokens():
    # prompt of 6 (the first turn shares the prompt's last block), turn 1 ends on a block boundary, a
    # 3-token observation, turn 2 starts inside the observation's block (decoded with it visible)
    t = trajectory([1, 2, 3, 4, 5, 6], [([7, 8], [50, 51, 52]), ([9, 10, 11, 12, 13], None)])
    assert len(t["ids"]) == 16
    single_prompt, single_resp = [1, 2, 3], [20, 21, 2]
    s = sample_of(t)
    batch = build_learner_batch([s.prompt_ids, single_prompt], [s.token_ids, single_resp], torch.zeros(2),
                                torch.arange(2), pad_id=0, turns=[(t["generated"], t["segment"]), None], block_size=K)
    expected = torch.zeros(2, 16, dtype=torch.bool)
    for j, g in enumerate(t["generated"]):  # plain loop: the model's tokens, nothing else
        expected[0, j] = g
    for j in range(len(single_resp)):
        expected[1, len(single_prompt) + j] = True
    assert torch.equal(batch.response_mask, expected)
    assert batch.input_ids[0].tolist() == t["ids"]


def test_learner_batch_refuses_a_turn_sharing_its_block_with_the_future():
    # turn 1 ends at position 7, inside block 1, and the observation follows in the same block
    t = trajectory([1, 2, 3, 4, 5, 6], [([7], [50, 51]), ([9, 10, 11], None)])
    s = sample_of(t)
    with pytest.raises(ValueError, match="row 0 block 1"):
        build_learner_batch([s.prompt_ids], [s.token_ids], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                            pad_id=0, turns=[(t["generated"], t["segment"])], block_size=K)


def test_rollout_sample_checks_its_trajectory():
    t = trajectory([1, 2], [([7, 8], None)])
    with pytest.raises(ValueError, match="token_ids"):
        RolloutSample(token_ids=[7], text="", num_forwards=1, tpf=1.0, num_edits=0, finished_by_eos=True, trajectory=t)
    bad = dict(t, generated=t["generated"][:-1])
    with pytest.raises(ValueError, match="differ in length"):
        sample_of(bad)
    assert sample_of(t).prompt_ids == [1, 2]


def test_rollout_worker_multi_turn_records():
    """The worker's multi-turn path on the shipped tiny agent: every sample is a valid record whose
    learner row scores the model's tokens only, and the tool's answer is context."""
    from rewards.envs import make_environment
    from rollout.worker import RolloutWorker

    from ebpo.infra.data import encode_prompt

    worker = RolloutWorker("tiny-agent", {"preset": "quality"}, num_threads=1,
                           env_factory=functools.partial(make_environment, "calculator", {"max_turns": 3}),
                           multiturn={"max_turn_tokens": 96, "max_total_tokens": 320})
    rows = [{"prompt": "Compute 482*37.", "answer": "17834"}, {"prompt": "What is 482 times 37?", "answer": "17834"}]
    prompts = [encode_prompt(worker.tokenizer, r["prompt"]) for r in rows]
    outs = [RolloutSample.from_worker(o) for o in worker.generate(prompts, [1, 2], rows=rows)]
    K = worker.model.config.block_size
    called = [o for o in outs if o.trajectory["turns"][0]["tool_calls"]]
    assert called, "tiny-agent calls the calculator on 'Compute ...'"
    for o, p in zip(outs, prompts):
        t = o.trajectory
        assert o.prompt_ids == p and len(t["ids"]) % K == 0
        assert o.text == t["turns"][-1]["text"]
        batch = build_learner_batch([o.prompt_ids], [o.token_ids], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                                    pad_id=0, turns=[(t["generated"], t["segment"])], block_size=K)
        scored = [tok for tok, m in zip(batch.input_ids[0].tolist(), batch.response_mask[0].tolist()) if m]
        model_tokens = [tok for tok, g in zip(t["ids"], t["generated"]) if g]
        assert scored == model_tokens
    obs = called[0].trajectory["turns"][0]
    text = worker.tokenizer.decode(called[0].trajectory["ids"][obs["obs_start"]:obs["obs_end"]])
    assert "17834" in text and not any(called[0].trajectory["generated"][obs["obs_start"]:obs["obs_end"]])
