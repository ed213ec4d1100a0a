"""Moved to tests/support/stub_lm.py. This name stays only while tests/rollout/test_static_slots.py imports from it;
delete it when that file imports from `tests.support.stub_lm`."""
from tests.support.stub_lm import K, Rule, ScriptEnv, StubLM, StubTokenizer  # noqa: F401
