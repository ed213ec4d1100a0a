"""The eager engine (`rollout.engine`, `compiled_step` off) keeps every tensor on the model's device: it decodes
under a `meta` default device exactly what it decodes without one (greedy, sampled, T2T, DELETE / INSERT, MBE).
The model and generators are built on the CPU first, as a GPU user's are on the GPU, and the engine under the
`meta` default; a slot tensor or index created without the model's device would land on `meta` and fail where it
meets the CPU model (issue 40's device mutants of engine.py, which only a second device shows otherwise)."""
import pytest

from test_static_slots_devices_mt40 import CASES, _run


@pytest.mark.parametrize("max_batch", [2, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_eager_engine_decodes_the_same_under_a_meta_default_device(case, max_batch):
    assert _run(case, max_batch, "meta", compiled_step=False) == _run(case, max_batch, None, compiled_step=False)
