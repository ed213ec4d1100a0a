"""`rollout.runners.make_runner`: the runner an engine drives, by the documented choice: a parallel model's rank
gets the parallel runner, else `cfg.compiled_step` picks the compiled step's runner, else the eager one; each
built for the engine's slots, canvas, block size and token ids."""
import pytest

import rollout.compiled as compiled
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from ebpo.model.parallel import build_parallel_model
from rollout.config import DecodeConfig
from rollout.parallel_runner import ParallelRunner
from rollout.runner import EagerRunner
from rollout.runners import make_runner
from rollout.static_slots import CompiledRunner
from tests.support.stub_engine_model import DEL_ID, INS_ID, EOS, MASK, StubModel

K = 4


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


def _make(model, cfg, share_prefix=True, lev=None):
    return make_runner(model, cfg, max_batch=3, canvas_len=16, K=K, mask_id=MASK, eos_ids={EOS}, model_lev_ids=lev,
                       share_prefix=share_prefix)


def _sized(r, lev=None):
    """The runner holds the engine's slots, canvas, block size and ids."""
    return ((r.B, r.T, r.K, r.mask_id, r.model_lev_ids) == (3, 16, K, MASK, lev)
            and tuple(r.slots.canvas.shape) == (3, 16) and bool((r.slots.canvas == MASK).all()))


@pytest.mark.parametrize("share_prefix", [True, False])
def test_a_plain_model_gets_the_eager_runner(share_prefix):
    r = _make(StubModel(K), DecodeConfig.preset("quality"), share_prefix)
    assert type(r) is EagerRunner and _sized(r)
    assert r.share_prefix is share_prefix and r.cache is not None


def test_without_the_cache_the_eager_runner_shares_no_prefix():
    r = _make(StubModel(K), DecodeConfig.preset("quality", use_cache=False))
    assert type(r) is EagerRunner and r.cache is None and r.share_prefix is False


@pytest.mark.parametrize("lev, edits", [(None, {}), ((DEL_ID, INS_ID), {}),
                                        ((DEL_ID, INS_ID), dict(tau_delete=0.5, tau_insert=0.5))])
def test_compiled_step_gets_the_compiled_runner(lev, edits):
    cfg = DecodeConfig.preset("quality", compiled_step=True, **edits)
    r = _make(StubModel(K, lev=lev is not None), cfg, lev=lev)
    assert type(r) is CompiledRunner and _sized(r, lev) and r.cfg is cfg
    assert r.share_prefix is False and r.cache is None  # the step keeps its own static cache
    assert r.step.eos == [EOS] and r.step.T == 16
    assert r.step.lev_ids == (lev if edits else None)  # the model's edit ids, used when the settings edit


def test_a_parallel_model_gets_the_parallel_runner_whatever_the_config():
    """One process, no groups: a rank's parallel model is the whole model."""
    full = make_model(seed=3)
    model = build_parallel_model(full, full.config)
    r = _make(model, DecodeConfig.preset("quality"), share_prefix=False)
    assert type(r) is ParallelRunner and (r.B, r.T, r.K) == (3, 16, K) and r.share_prefix is False
    with pytest.raises(ValueError, match="compiled_step"):
        _make(model, DecodeConfig.preset("quality", compiled_step=True))
    assert type(_make(full, DecodeConfig.preset("quality"))) is EagerRunner  # the same weights, not parallel
