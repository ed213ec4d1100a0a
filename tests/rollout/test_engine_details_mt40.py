"""Moved: the engine's detail tests are tests/rollout/engine/test_details.py, this helper tests/support/stub_lm.py.
This name stays only while tests/rollout/test_static_slots.py imports `exported_at_a_boundary` from it; delete it
when that file imports from `tests.support.stub_lm`."""
from tests.support.stub_lm import exported_at_a_boundary  # noqa: F401
