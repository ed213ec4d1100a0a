"""Shared prompt prefixes (`rollout.prefix_share`): sequences with the same whole prompt blocks compute their
keys/values once and decode exactly what they decode alone.

The stub model's cache holds (token, position) keys and its logits are a function of every key a position
attends, so a copied prefix that is short, long, from the wrong row or stale changes the tokens; the reference is
the plain decoder of tests/support/stub_engine_model.py, each sequence alone.
"""
import pytest
import torch
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from tests.support.stub_engine_model import StubModel, ref_single

from rollout import DecodeConfig, generate
from rollout.engine import Engine

K = 4
GROUP = [3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6]  # 2 whole blocks + 3 prompt tokens in the first active block
OTHER = [5, 4, 3, 6, 7, 8, 9, 3, 4]  # shares no whole block with GROUP
CFG = DecodeConfig.preset("quality", max_post_steps=2)


def _engine(stub, max_batch, share, cfg=CFG):
    return Engine(stub, cfg, max_batch=max_batch, canvas_len=8 * K, share_prefix=share)


@pytest.mark.parametrize("max_batch", [2, 4, 8])
def test_a_group_shares_its_prompt_blocks_and_decodes_like_each_alone(max_batch):
    """Four samples of one prompt and two others: every sequence's tokens, traces and forwards equal the reference
    alone; with sharing the engine runs (G - 1) x the prompt's whole blocks fewer prompt positions whenever a
    group member is live when the next one is admitted."""
    stub = StubModel(K=K, seed=3, eos_rate=0.1)
    prompts = [GROUP, OTHER, GROUP, GROUP, OTHER[:5], GROUP]
    lens = [9, 6, 9, 7, 5, 10]
    runs = {}
    for share in (False, True):
        eng = _engine(stub, max_batch, share)
        seqs = [eng.submit(p, max_new_tokens=m) for p, m in zip(prompts, lens)]
        eng.run()
        runs[share] = eng
        for s, p, m in zip(seqs, prompts, lens):
            rs = ref_single(stub, p, m, CFG)
            assert s.canvas == rs.x[:rs.num_blocks * K] and s.trace == rs.trace[:rs.num_blocks * K]
            assert s.forwards == rs.forwards
    saved = runs[False].runner.prompt_tokens_computed - runs[True].runner.prompt_tokens_computed
    if max_batch == 8:  # all admitted at once: one GROUP computes, three copy 8; OTHER[:5] copies OTHER's block
        assert saved == 3 * 8 + 4
    assert 0 <= saved <= 3 * 8 + 4


def test_without_a_live_source_a_sequence_computes_its_prompt_itself():
    """One slot: each group member is admitted after the previous one finished, so nothing can be copied and the
    counts equal the unshared engine's."""
    stub = StubModel(K=K, seed=4)
    counts = []
    for share in (False, True):
        eng = _engine(stub, 1, share)
        seqs = [eng.submit(GROUP, max_new_tokens=6) for _ in range(3)]
        eng.run()
        counts.append(eng.runner.prompt_tokens_computed)
        for s in seqs:
            assert s.canvas == ref_single(stub, GROUP, 6, CFG).x[:s.num_blocks * K]
    assert counts[0] == counts[1] > 3 * 8  # whole blocks once each, the partial block every forward of its block


def test_sampled_group_on_the_tiny_model_equals_generate_alone():
    """Eight seeded samples of a 40-token prompt (5 whole blocks of 8) on the real tiny model: each equals
    `generate` of that prompt and seed alone; the prompt blocks run once instead of eight times."""
    torch.set_num_threads(1)
    model = make_model(seed=5)
    prompt = list(range(3, 43))
    cfg = DecodeConfig.preset("speed", temperature=0.8, max_new_tokens=16)
    eng = Engine(model, cfg, max_batch=8, canvas_len=64)
    seqs = [eng.submit(prompt, torch.Generator().manual_seed(s)) for s in range(8)]
    eng.run()
    for i, s in enumerate(seqs):
        alone = generate(model, [prompt], cfg, seeds=[i])[0]
        assert s.canvas[40:40 + len(alone.token_ids)] == alone.token_ids and s.forwards == alone.num_forwards
    assert eng.runner.prompt_tokens_computed == 40  # 40 prompt tokens = 5 whole blocks, computed by the first sample only
