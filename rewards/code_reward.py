"""The built-in ``code`` reward: run the completion's code against the row's tests in the sandbox.

score = passed tests / all tests. The code is the last ```python (or untagged) fenced block when there
is one, else the whole completion. Infrastructure failures (sandbox did not start) score *skip*;
everything the candidate can cause (crash, timeout, killed harness) scores as failed tests.
"""
from __future__ import annotations

from rewards.api import RewardResult, skip
from rewards.code_tests import TestFormatError, compile_test, judge
from rewards.format_reward import code_blocks
from rewards.sandbox import Limits, SandboxError, resolve_mode, run_tests

_LANGS = ("python", "py", "python3", "")


def extract_code(completion: str) -> str:
    """Last python/untagged fenced block, else the whole completion (stripped of a lone fence line)."""
    blocks = [body for lang, body in code_blocks(completion or "") if lang in _LANGS]
    return blocks[-1] if blocks else (completion or "")


def code_reward(*, completion: str, tests, sandbox: str = "auto", test_timeout_s: float = 2.0,
                total_timeout_s: float = 20.0, memory_mb: int = 1024, max_procs: int = 32,
                **_) -> RewardResult:
    """Pass rate of the completion's code on ``tests`` (assert strings and/or {"input","output"} dicts).

    extras: ``passed``, ``total``, ``sandbox`` (mode in force), ``outcomes`` (per-test reason),
    ``exec_tests`` (tests judged inside the sandbox, see code_tests).
    """
    if not tests:
        return skip("no tests")
    if isinstance(tests, (str, dict)):
        tests = [tests]
    try:
        compiled = [compile_test(t, i) for i, t in enumerate(tests)]
    except TestFormatError as e:
        return skip(f"bad test: {e}")
    limits = Limits(test_timeout_s=test_timeout_s, total_timeout_s=total_timeout_s, memory_mb=memory_mb,
                    max_procs=max_procs)
    try:
        info = resolve_mode(sandbox)
        records = run_tests(extract_code(completion), [c["sandbox"] for c in compiled], limits, info)
    except (SandboxError, OSError) as e:
        return skip(f"sandbox failure: {e}"[:300])
    verdicts = [judge(c, r) for c, r in zip(compiled, records)]
    passed = sum(ok for ok, _ in verdicts)
    return RewardResult(passed / len(compiled), {
        "passed": passed, "total": len(compiled), "sandbox": info.mode,
        "outcomes": [why for _, why in verdicts], "exec_tests": sum(bool(c.get("exec")) for c in compiled)})
