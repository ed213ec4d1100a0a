"""Sharded candidates (ebpo.model.parallel.sampling) in 2 and 4 gloo ranks, each holding a slice of the
vocabulary, against the decoder's single-process sampler (`rollout.sampling.candidates_reference`) on the same
logits: identical tokens (argmax with ties, Gumbel-max from per-row generators, top-k, top-p with a nucleus larger
than the first search window, repetition penalty) and probabilities within fp32 rounding."""
from __future__ import annotations

import pytest
import torch

from ebpo.model.parallel import VocabShard, sharded_candidates, sharded_token_probs
from rollout.sampling import candidates_reference
from tests.model.parallel import parallel_ranks as pr

WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("setting", pr.SAMPLING, ids=[s[0] for s in pr.SAMPLING])
def test_sharded_candidates_equal_the_single_process_sampler(world, setting):
    name, *_, scale = setting
    ranks = pr.run_ranks(world)
    ref_tok, ref_prob = pr.single_sampling()[name]
    rtol = pr.prob_rtol(scale * 6, pr.SAMPLING_V)  # randn * scale stays within 6 scales
    for r in ranks:
        tok, prob = r["sampling"][name]
        assert torch.equal(tok, ref_tok)
        assert torch.allclose(prob, ref_prob, rtol=rtol, atol=0)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_token_probs_equal_the_softmax(world):
    for r in pr.run_ranks(world):
        assert torch.allclose(r["sampling"]["probs"], pr.single_sampling()["probs"], rtol=pr.prob_rtol(18, pr.SAMPLING_V),
                              atol=0)


def test_the_scenarios_reach_the_cases_they_are_named_for():
    """An exact tie across the shards' halves (index 3 wins), which the penalty moves, and a flat nucleus larger
    than the sharded top-p search's first window (so the search grows)."""
    from ebpo.model.parallel.sampling import TOP_P_FIRST_M
    from rollout.sampling import filter_top_k_top_p

    greedy = pr.single_sampling()["greedy"][0][0, 0]
    penalised = pr.single_sampling()["greedy_penalty"][0][0, 0]
    assert greedy == 3 and penalised == pr.SAMPLING_V - 5
    _, T, k, p, _, scale = next(s for s in pr.SAMPLING if s[0] == "top_p_flat")
    nucleus = torch.isfinite(filter_top_k_top_p(pr.sampling_logits(scale) / T, k, p)).sum(-1)
    assert (nucleus > TOP_P_FIRST_M).all() and (nucleus < pr.SAMPLING_V).all()


def test_one_rank_is_the_single_process_sampler():
    """No group: the whole vocabulary on one rank, no collective."""
    x = pr.sampling_logits(3.0)
    shard = VocabShard(0, pr.SAMPLING_V, pr.SAMPLING_V, None)
    for T, k, p in ((0.0, 0, 1.0), (0.7, 5, 0.8)):
        tok, prob = sharded_candidates(x, shard, T, k, p, pr.generators())
        ref_tok, ref_prob = candidates_reference(x, T, k, p, pr.generators())
        assert torch.equal(tok, ref_tok) and torch.allclose(prob, ref_prob, rtol=pr.prob_rtol(18, pr.SAMPLING_V))
    assert torch.allclose(sharded_token_probs(x, shard, [0, 9]), x.softmax(-1)[..., [0, 9]], rtol=1e-5)


@pytest.mark.parametrize("bad,match", [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                       (dict(top_k=-1), "top_k"), (dict(generators=[None]), "generators")])
def test_bad_arguments_are_refused(bad, match):
    x = pr.sampling_logits(1.0)
    with pytest.raises(ValueError, match=match):
        sharded_candidates(x, VocabShard(0, pr.SAMPLING_V, pr.SAMPLING_V), **bad)
    with pytest.raises(ValueError, match="local logits"):
        sharded_candidates(x, VocabShard(0, 10, pr.SAMPLING_V))
