"""The compiled step's slots (`rollout.static_slots`, run eagerly) keep every tensor on the model's device: the
engine decodes under a `meta` default device exactly what it decodes without one. The model and generators are
built on the CPU first, as a GPU user's are on the GPU, and the engine under the `meta` default; any tensor the
slots create without the model's device would land on `meta` and fail (or change the tokens) where it meets the
CPU canvas. This is the rule a second device shows, checked on a CPU-only machine (issue 40's device mutants of
static_slots.py)."""
import contextlib

import pytest
import torch

import rollout.compiled as compiled
from rollout.config import DecodeConfig
from rollout.engine import Engine
from stub_model_mt40 import StubLM
from test_static_slots_mt40 import CASES, PROMPTS


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


def _run(case: int, max_batch: int, default_device: str | None, compiled_step: bool = True):
    """The sequences' outcomes of CASES[case] on the stub, the engine built and run under `default_device`."""
    opts, rule, margin, lev = CASES[case]
    opts = dict(opts)
    cfg = DecodeConfig.preset(opts.pop("preset"), max_new_tokens=18, compiled_step=compiled_step, **opts)
    model = StubLM(rule, margin=margin, lev=lev)
    gens = [torch.Generator().manual_seed(100 + i) if cfg.temperature > 0 else None for i in range(len(PROMPTS))]
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        engine = Engine(model, cfg, max_batch=max_batch, canvas_len=48)  # its canvas and static cache too
        for p, g in zip(PROMPTS, gens):
            engine.submit(p, g)
        seqs = engine.run()
    return [(s.canvas, s.trace, s.forwards, s.edits, s.deletes, s.inserts, s.lev_drafts, s.mbe_edits)
            for s in seqs]


@pytest.mark.parametrize("max_batch", [2, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_slots_decode_the_same_under_a_meta_default_device(case, max_batch):
    assert _run(case, max_batch, "meta") == _run(case, max_batch, None)
