"""`rollout.parallel_worker.ParallelRolloutWorker`: one worker whose ranks (torch.multiprocessing, gloo) each hold a
slice of the policy answers like the single-process `RolloutWorker` holding the whole policy: the same samples
from the same seeds, after a weight load too, and the same partial rollouts.

Weights come from tests/rollout/conftest.py's tiny model with a scaled LM head (confidences spread away from the
thresholds, see tests/rollout/test_parallel_runner.py); prompts are never empty.
"""
from __future__ import annotations

import pytest
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve

from rollout.parallel_worker import ParallelRolloutWorker
from rollout.worker import RolloutWorker

DECODE = dict(preset="speed", temperature=0.8, top_k=20, max_new_tokens=16, max_batch=3)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [23, 24]]
SEEDS = [11, 12, 13, 14, 15]


def _calls(worker) -> dict:
    out = {"first": worker.generate(PROMPTS, SEEDS),
           "greedy": worker.generate(PROMPTS, SEEDS, decode=dict(preset="quality", max_new_tokens=16))}
    worker.load_weights(make_model(seed=4).state_dict(), 1)
    out["after_load"] = worker.generate(PROMPTS, SEEDS)
    out["partial"] = worker.generate_partial(PROMPTS, SEEDS, tags=[0, 0, 1, 1, 2], quota=2)
    out["ping"] = worker.ping()
    return out


@pytest.fixture(scope="module")
def single():
    return _calls(RolloutWorker("preset:tiny", DECODE, weights=make_model(seed=3).state_dict()))


@pytest.mark.slow  # two spawned ranks and six calls: minutes on two shared cores
def test_two_rank_worker_answers_like_one_process(single):
    """TP=2 x EP=2 on two ranks: generate (sampled, then greedy), load_weights (each rank its slices) and
    generate_partial give the single-process worker's answers."""
    worker = ParallelRolloutWorker("preset:tiny", DECODE, tensor_parallel=2, expert_parallel=2,
                                   weights=make_model(seed=3).state_dict())
    try:
        got = _calls(worker)
        digests = worker.weights_digest()
    finally:
        worker.close()
    assert got["first"] != got["after_load"]  # the new weights changed the samples
    for key in ("first", "greedy", "after_load", "partial"):
        assert got[key] == single[key], key
    assert got["ping"] == 1 and len(digests) == 2 and digests[0] != digests[1]  # each rank holds other slices


@pytest.mark.slow
def test_a_failing_rank_call_raises_with_the_ranks_traceback():
    worker = ParallelRolloutWorker("preset:tiny", DECODE, tensor_parallel=2)
    try:
        with pytest.raises(RuntimeError, match="ShardLoader"):
            worker.load_weights({"model.norm.weight": make_model().state_dict()["model.norm.weight"]}, 1)
        assert worker.ping() == 0  # the worker still answers after a failed call
    finally:
        worker.close()
