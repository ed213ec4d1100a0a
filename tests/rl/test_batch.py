"""Pure helpers of the RL step (ebpo.rl.batch): group filters and the step's reward and rollout metrics."""
import torch

from ebpo.rl.batch import filter_groups, reward_metrics, rollout_metrics, zero_std_groups
from ebpo.rl.records import RolloutSample, build_learner_batch


def test_build_learner_batch_masks_only_response_tokens():
    b = build_learner_batch([[5, 6, 7], [5]], [[9, 1], [8, 8, 8, 1]], torch.tensor([1.0, -1.0]),
                            torch.tensor([0, 0]), pad_id=1)
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 1], [5, 8, 8, 8, 1]]
    assert b.response_mask.tolist() == [[False, False, False, True, True], [False, True, True, True, True]]
    assert b.prompt_lens.tolist() == [3, 1] and b.response_lens.tolist() == [2, 4]


def test_group_statistics_against_hand_computed_values():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert zero_std_groups(scores, groups).tolist() == [True, False, True]
    m = reward_metrics(scores, groups, {"math": [1, 1, 0, 1, None, 0]})
    assert abs(m["frac_zero_std_groups"] - 2 / 3) < 1e-9
    assert abs(m["reward/math/mean"] - 0.6) < 1e-9  # the skip is excluded
    assert filter_groups(~zero_std_groups(scores, groups), groups).tolist() == [False, False, True, True, False, False]


def test_rollout_metrics_clip_ratio_and_tpf():
    samples = [
        RolloutSample(token_ids=[3, 4, 1], text="", tpf=1.0, finished_by_eos=True, num_forwards=3, num_edits=1),
        RolloutSample(token_ids=[3, 4, 5, 6], text="", tpf=4.0, finished_by_eos=False, num_forwards=1, num_edits=0),
    ]
    m = rollout_metrics(samples, max_new_tokens=4, seconds=2.0)
    assert m["response_length/clip_ratio"] == 0.5 and m["decode/tpf"] == 7 / 4
    assert m["perf/rollout_tokens_per_s"] == 3.5 and m["decode/edits_per_seq"] == 0.5
    assert m["decode/lev_share"] == 0.0


def test_rollout_metrics_lev_share_counts_responses_with_a_levenshtein_block():
    def sample(drafts):
        return RolloutSample(token_ids=[3, 1], text="", tpf=1.0, finished_by_eos=True, num_forwards=2, num_edits=0,
                             lev_drafts=drafts)
    # 2 of 5 responses carry pre-edit drafts (one of them two blocks): the share counts responses, not blocks
    samples = [sample([]), sample([[0, [5, 6]]]), sample([]), sample([[0, [5]], [16, [7]]]), sample([])]
    assert rollout_metrics(samples, max_new_tokens=4, seconds=1.0)["decode/lev_share"] == 2 / 5


def test_first_groups_keeps_the_first_k_true_entries_like_a_loop():
    import torch

    from ebpo.rl.batch import first_groups

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(0, 12, (1,), generator=g))
        keep = torch.rand(n, generator=g) < 0.5
        k = int(torch.randint(0, 8, (1,), generator=g))
        expected, seen = [], 0
        for v in keep.tolist():
            expected.append(bool(v) and seen < k)
            seen += bool(v)
        assert first_groups(keep, k).tolist() == expected


def test_progress_line_names_each_task_once():
    from ebpo.rl.step import progress_info

    both = {"reward/mean": 0.5, "eval/accuracy": 0.975, "eval/math/accuracy": 0.975, "eval/math/tpf": 3.0}
    assert progress_info(both) == "reward 0.500 math acc 0.975"
    assert progress_info({"reward/mean": 0.5, "eval/accuracy": 0.9}) == "reward 0.500 eval acc 0.900"
    assert progress_info({"reward/mean": 0.25}) == "reward 0.250"
