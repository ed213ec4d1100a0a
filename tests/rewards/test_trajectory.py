"""Trajectory reward terms: computed from the record's turns and tool calls, weighted by the RewardWorker;
single-turn samples (trajectory None) skip them and score as before."""
import pytest

from rewards import RewardSpec, RewardWorker
from rewards.trajectory import task_completion, tool_call_validity, turn_format


def traj(calls, stop="done", env_reward=1.0, failed=False, finished=("tool_call", "eos")):
    turns = [{"text": "t", "finished_by": f, "tool_calls": c} for f, c in zip(finished, calls)]
    return {"turns": turns, "stop": stop, "failed": failed, "env_reward": env_reward}


OK = {"name": "calc", "ok": True, "invalid": False}
BAD = {"name": "mul", "ok": False, "invalid": True}


def test_terms_by_hand():
    assert task_completion(trajectory=traj([[OK], []])).score == 1.0
    assert task_completion(trajectory=traj([[OK], []], failed=True)).score == 0.0
    assert tool_call_validity(trajectory=traj([[OK, BAD], [OK]])).score == pytest.approx(2 / 3)
    assert tool_call_validity(trajectory=traj([[], []])).score == 0.0
    assert turn_format(trajectory=traj([[OK], []])).score == 1.0
    assert turn_format(trajectory=traj([[OK], []], finished=("budget", "eos"))).score == 0.5
    assert turn_format(trajectory=traj([[OK], []], stop="max_turns")).score == 0.0
    for fn in (task_completion, tool_call_validity, turn_format):
        assert fn(trajectory=None).score is None  # single-turn: skipped


def test_weighted_by_the_worker_and_single_turn_unchanged():
    specs = [RewardSpec("task_completion", 1.0), RewardSpec("tool_call_validity", 0.2), RewardSpec("turn_format", 0.1),
             RewardSpec("format_boxed", 0.5)]
    w = RewardWorker(specs, num_workers=1, timeout_s=10)
    try:
        multi = {"prompt": "p", "completion": "\\boxed{5}", "answer": "5", "trajectory": traj([[OK, BAD], []])}
        single = {"prompt": "p", "completion": "\\boxed{5}", "answer": "5"}
        out = w.score([multi, single])
        assert out[0]["score"] == pytest.approx(1.0 + 0.2 * 0.5 + 0.1 * 1.0 + 0.5 * 1.0)
        assert out[1]["score"] == pytest.approx(0.5)  # only format_boxed: the trajectory terms skip
        alone = RewardWorker([RewardSpec("format_boxed", 0.5)], num_workers=1, timeout_s=10)
        try:
            assert alone.score([single])[0]["score"] == out[1]["score"]
        finally:
            alone.close()
    finally:
        w.close()
