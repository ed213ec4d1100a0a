"""Fixtures shared by the tests of the sandbox's start-up probes (test_sandbox_fs.py, test_sandbox_uids.py)."""
import pytest

import rewards.sandbox as sandbox
import rewards.sandbox_fs as sandbox_fs


def _clear_probe_caches():
    for fn in (sandbox._interpreter, sandbox.mode_works, sandbox_fs.interpreter_info, sandbox.uid_range_checked):
        fn.cache_clear()


@pytest.fixture
def fresh_probes():
    """Each test probes the sandbox anew, and later tests probe the real interpreter again."""
    _clear_probe_caches()
    yield
    _clear_probe_caches()
