"""The records side of per-block weight versions (`ebpo.rl.records`: pad_block_versions, build_learner_batch's
block_versions, LearnerBatch's checks), against their docstrings: refusals with their exact messages, rows
without a list in a batch of several, a version 0 past the batch's blocks, zero-column and zero-row batches
(issue 40's survivors of records.py after block_versions landed)."""
import re

import pytest
import torch

from ebpo.rl.records import LearnerBatch, build_learner_batch, pad_block_versions


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
