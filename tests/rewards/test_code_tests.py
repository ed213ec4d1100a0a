"""Compiling a row's tests (rewards/code_tests.py): tests the judge cannot run are counted, warned about once per
process, and fail (never pass); the audit counts every kind of test."""
import pytest

from rewards.sandbox import resolve_mode
from tests.rewards.hostile import FAST, HUMANEVAL


def test_unsupported_tests_warn_once_and_are_counted(monkeypatch, recwarn):
    import rewards.code_tests as ct
    from rewards import RewardWorker
    from rewards.code_tests import audit_tests
    monkeypatch.setattr(ct, "_WARNED", set())
    loop = "for x in range(3):\n    assert add(x, 1) == x + 1"
    peek = ["assert add.__name__ == 'add'", "import inspect\nassert 'return' in inspect.getsource(add)"]
    counts = audit_tests([{"tests": [HUMANEVAL, loop]}, {"tests": ["assert True", "assert add(1, 2) == 3"]}])
    assert counts == {"rows": 2, "tests": 4, "scored": 5, "assert": 4, "stdio": 0, "program": 1, "split": 3,
                      "vacuous": 2, "unsupported": 0, "bad": 0}
    assert not [w for w in recwarn if "code reward" in str(w.message)]  # programs are no longer weaker
    assert audit_tests([{"tests": peek}])["unsupported"] == 2
    assert audit_tests([{"tests": peek}])["unsupported"] == 2
    assert len([w for w in recwarn if "cannot run them" in str(w.message)]) == 1  # loudly, once per process
    specs = [("code", 1.0, {**FAST, "sandbox": resolve_mode().mode})]
    with RewardWorker(specs, num_workers=0) as w:
        out = w.score([{"completion": "def add(a, b):\n    return a + b", "tests": [loop, "assert True", *peek]}] * 2)
        stats = w.stats()
    assert out[0]["score"] == pytest.approx(1 / 3), out  # the unsupported tests fail, never pass
    assert out[0]["extras"]["code"]["outcomes"] == ["ok", "unsupported", "unsupported"]
    assert stats["reward/program_tests"] == 4 and stats["reward/vacuous_tests"] == 2  # the loop + the import
    assert stats["reward/unsupported_tests"] == 4
