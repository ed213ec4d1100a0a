"""The rollout engine on a tensor- / expert-parallel model (`rollout.parallel_runner.ParallelRunner`): every rank
of a gloo group runs an `Engine` over the same prompts, settings and seeds, and decodes the same tokens as the
single-process engine (`EagerRunner`) on the full model.

The reference is the single-process engine with the same prompts, settings and seeds. The parallel model's hidden
states differ from one process by summation order only (docs/parallel.md); the tiny model's LM head is scaled up
(tests/rollout/conftest.py) so that confidences spread away from each other and from the thresholds, and no prompt
is empty (an all-[MASK] first block is a known exact tie between positions). Greedy and sampled rows, top-k, top-p,
the repetition penalty, Multi-Block Editing, Levenshtein editing and shared prompt prefixes share the forwards.
Besides the tokens, the test compares each sequence's generator state at the end: a sampled row draws from its own
generator exactly as in one process.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ebpo.infra.distributed import free_port
from ebpo.model.parallel import build_parallel_model, make_groups
from rollout import DecodeConfig
from rollout.engine import Engine
from rollout.parallel_runner import ParallelRunner
from rollout.runner import EagerRunner
from tests.support.models import decoding_lm as make_model  # importable in spawned ranks, unlike conftest

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [23, 24],
           [14, 15, 16, 17, 18, 19, 20, 21, 30, 31], [23, 24, 25, 26], [40, 41, 42]]
# (preset, overrides): greedy and sampled rows with every per-request decision setting
SETTINGS = [
    ("quality", dict(temperature=0.6)),
    ("speed", dict(temperature=0.9, top_k=5)),
    ("quality", dict(temperature=1.2, top_p=0.8)),
    ("speed", dict(repetition_penalty=3.0)),
    ("quality", dict(max_post_steps=2, mbe_window=1, mbe_tau=0.7, mbe_max_passes=3)),
    ("quality", dict(temperature=0.7, max_post_steps=1, tau_delete=0.3, tau_insert=0.3, max_lev_edits=1)),
    ("speed", dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=0.5)),
    ("quality", dict(max_post_steps=1, early_commit=0.9)),
]
MAX_BATCH, CANVAS, MAX_NEW, SEED = 4, 40, 16, 100


def decode(model) -> list[dict]:
    """Every sequence's canvas, trace, counters and final generator state after one engine run on `model` (the
    full model or this rank's parallel model); also the engine's forward counts."""
    cfgs = [DecodeConfig.preset(p, max_new_tokens=MAX_NEW, **kw) for p, kw in SETTINGS]
    eng = Engine(model, cfgs[0], max_batch=MAX_BATCH, canvas_len=CANVAS)
    gens = [torch.Generator().manual_seed(SEED + i) for i in range(len(PROMPTS))]
    seqs = [eng.submit(p, g, config=c) for p, g, c in zip(PROMPTS, gens, cfgs)]
    eng.run()
    out = [dict(canvas=s.canvas, trace=s.trace, counts=(s.forwards, s.edits, s.mbe_edits, s.deletes, s.inserts),
                stop=s.stop, gen=g.get_state()) for s, g in zip(seqs, gens)]
    return [dict(runner=type(eng.runner).__name__, forwards=(eng.num_forwards, eng.row_forwards),
                 prompt_tokens=eng.runner.prompt_tokens_computed)] + out


def _rank(rank: int, world: int, port: int, folder: str, layouts) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state = torch.load(Path(folder) / "full.pt", mmap=True)
        results = {}
        for tp, ep in layouts:
            tp_group, ep_group = make_groups(tp, ep)  # every rank creates the same subgroups in the same order
            model = build_parallel_model(iter(state.items()), make_model().config, tp_group, ep_group)
            results[(tp, ep)] = decode(model)
        torch.save(results, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, layouts) -> list[dict]:
    folder = tempfile.mkdtemp(prefix=f"prunner{world}_")
    torch.save(make_model(seed=3).state_dict(), Path(folder) / "full.pt")
    mp.spawn(_rank, args=(world, free_port(), folder, layouts), nprocs=world, join=True)
    return [torch.load(Path(folder) / f"rank{r}.pt") for r in range(world)]


def _same(got: list[dict], ref: list[dict], what: str) -> None:
    assert got[0]["runner"] == "ParallelRunner" and ref[0]["runner"] == "EagerRunner"
    assert got[0]["forwards"] == ref[0]["forwards"] and got[0]["prompt_tokens"] == ref[0]["prompt_tokens"], what
    for i, (g, r) in enumerate(zip(got[1:], ref[1:])):
        assert g["canvas"] == r["canvas"] and g["trace"] == r["trace"], f"{what}: sequence {i} tokens"
        assert g["counts"] == r["counts"] and g["stop"] == r["stop"], f"{what}: sequence {i} counters"
        assert torch.equal(g["gen"], r["gen"]), f"{what}: sequence {i} generator state"


@pytest.fixture(scope="module")
def reference():
    return decode(make_model(seed=3))


def test_reference_is_decisive(reference):
    """The scenario exercises what it claims: sampled rows drew, the settings made edits, prompts were shared."""
    seqs = reference[1:]
    assert all(len(s["canvas"]) > len(p) for s, p in zip(seqs, PROMPTS))
    fresh = [torch.Generator().manual_seed(SEED + i).get_state() for i in range(len(PROMPTS))]
    drew = [not torch.equal(s["gen"], f) for s, f in zip(seqs, fresh)]
    assert drew == [cfg.get("temperature", 0.0) > 0 for _, cfg in SETTINGS]
    assert reference[0]["forwards"][0] < reference[0]["forwards"][1]  # rows shared forwards


def test_two_ranks_decode_the_single_process_tokens(reference):
    """TP=2, EP=2 and TP=2 x EP=2 on two gloo ranks: every rank, every sequence: the same tokens, trace, counters,
    stop reason, generator state and engine forwards as one process."""
    layouts = [(2, 1), (1, 2), (2, 2)]
    ranks = run_ranks(2, layouts)
    for layout in layouts:
        for r, res in enumerate(ranks):
            _same(res[layout], reference, f"tp x ep = {layout}, rank {r}")


@pytest.mark.slow
def test_four_ranks_decode_the_single_process_tokens(reference):
    """TP=4 (more ranks than KV heads), EP=4, TP=2 x EP=4 and TP=4 x EP=4 on four gloo ranks."""
    layouts = [(4, 1), (1, 4), (2, 4), (4, 4)]
    ranks = run_ranks(4, layouts)
    for layout in layouts:
        for r, res in enumerate(ranks):
            _same(res[layout], reference, f"tp x ep = {layout}, rank {r}")


def test_make_runner_picks_the_parallel_runner_and_refuses_the_compiled_step():
    """One process, no groups: the parallel model of one rank is a whole model; make_runner gives it the parallel
    runner (the engine does not know), and the compiled step is refused with the field named."""
    full = make_model(seed=3)
    model = build_parallel_model(full, full.config)
    eng = Engine(model, DecodeConfig.preset("quality", max_new_tokens=8), max_batch=2, canvas_len=16)
    assert isinstance(eng.runner, ParallelRunner)
    assert isinstance(Engine(full, DecodeConfig.preset("quality"), max_batch=2, canvas_len=16).runner, EagerRunner)
    assert tuple(eng.runner.cache.k[0].shape) == tuple(model.new_cache(2, 16).k[0].shape)
    with pytest.raises(ValueError, match="compiled_step"):
        Engine(model, DecodeConfig.preset("quality", compiled_step=True), max_batch=2, canvas_len=16)
