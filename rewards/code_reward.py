"""The built-in ``code`` reward: run the completion's code in the sandbox, the row's tests in the judge.

score = passed tests / scored tests. The code is the last ```python (or untagged) fenced block when
there is one, else the whole completion (found in linear time: format_reward.code_blocks). Tests that
never refer to the candidate are left out of the score (``vacuous_tests``). Infrastructure failures
(sandbox did not start) score *skip*; everything the candidate can cause (crash, timeout, killed
harness, garbage answers) scores as failed tests. One call takes at most ``total_budget_s``, running
and judging together: the parent kills the sandbox and the judge's child by then.
"""
from __future__ import annotations

import inspect
import os

from rewards.api import RewardResult, as_spec, skip
from rewards.code_tests import TestFormatError, compile_tests, warn_unsupported_tests
from rewards.format_reward import code_blocks
from rewards.sandbox import Limits, SandboxError, resolve_mode, run_tests, wall_bound_s

_LANGS = ("python", "py", "python3", "")
_CODE_REFS = ("code", "rewards.code_reward:code_reward")
PRIVATE_TMP_DIRS = ("/tmp", "/dev/shm", "/var/tmp")


def extract_code(completion: str) -> str:
    """Last python/untagged fenced block, else the whole completion (stripped of a lone fence line)."""
    blocks = [body for lang, body in code_blocks(completion or "") if lang in _LANGS]
    return blocks[-1] if blocks else (completion or "")


def _limits(test_timeout_s=2.0, total_timeout_s=20.0, memory_mb=1024, max_procs=32, tmp_mb=64,
            site_packages=()) -> Limits:
    for d in site_packages or ():
        real = os.path.realpath(d)
        if any(real == t or real.startswith(t + "/") for t in PRIVATE_TMP_DIRS):
            raise ValueError(f"code reward: site_packages entry {d!r} is under {', '.join(PRIVATE_TMP_DIRS)}, "
                             "which are hidden by the sandbox's private temporary directories; put it elsewhere")
    return Limits(test_timeout_s=float(test_timeout_s), total_timeout_s=float(total_timeout_s),
                  memory_mb=int(memory_mb), max_procs=int(max_procs), tmp_mb=int(tmp_mb),
                  site_packages=tuple(site_packages or ()))


def code_reward(*, completion: str, tests, prompt: str | None = None, sandbox: str = "auto",
                test_timeout_s: float = 2.0, total_timeout_s: float = 20.0, memory_mb: int = 1024,
                max_procs: int = 32, tmp_mb: int = 64, site_packages: list | None = None, **_) -> RewardResult:
    """Pass rate of the completion's code on ``tests`` (assert strings, programs such as HumanEval's
    ``check(candidate)``, and/or {"input","output"} dicts). ``prompt``: the task's prompt; helpers it
    defines in full (HumanEval/32's ``poly``) are bound from it in the judge, never from the candidate
    (rewards/prompt_helpers.py).

    extras: ``passed``, ``total`` (scored tests), ``sandbox`` (mode in force), ``outcomes`` (per scored
    test), ``program_tests`` (scored residual programs), ``vacuous_tests`` (left out),
    ``unsupported_tests`` (scored, always failed: see code_tests).
    """
    if not tests:
        return skip("no tests")
    if isinstance(tests, (str, dict)):
        tests = [tests]
    try:
        every = compile_tests(tests, prompt)
    except TestFormatError as e:
        return skip(f"bad test: {e}")
    compiled = [c for c in every if not c["vacuous"]]
    n_vacuous = len(every) - len(compiled)
    if not compiled:
        return skip("no test refers to the candidate", vacuous_tests=n_vacuous)
    n_unsupported = sum(bool(c["unsupported"]) for c in compiled)
    if n_unsupported:
        warn_unsupported_tests(n_unsupported, len(compiled), "of one row")
    runnable = [c["judge"] for c in compiled if not c["unsupported"]]
    limits = _limits(test_timeout_s, total_timeout_s, memory_mb, max_procs, tmp_mb, site_packages)
    try:
        info = resolve_mode(sandbox)
        ran = iter(run_tests(extract_code(completion), runnable, limits, info) if runnable else [])
    except (SandboxError, OSError) as e:
        return skip(f"sandbox failure: {e}"[:300])
    verdicts = [(False, "unsupported") if c["unsupported"] else next(ran) for c in compiled]
    passed = sum(ok for ok, _ in verdicts)
    return RewardResult(passed / len(compiled), {
        "passed": passed, "total": len(compiled), "sandbox": info.mode, "outcomes": [why for _, why in verdicts],
        "program_tests": sum(bool(c.get("program")) for c in compiled), "vacuous_tests": n_vacuous,
        "unsupported_tests": n_unsupported})


def total_budget_s(kwargs: dict | None = None) -> float:
    """Longest one ``code`` reward call can take with these kwargs (the sandbox is killed from outside
    by then): ``total_timeout_s`` plus the start-up and clean-up margins. A reward worker's per-call
    timeout must be longer, or an honest slow program is killed as a hung call."""
    defaults = {k: p.default for k, p in inspect.signature(_limits).parameters.items()}
    given = {k: v for k, v in (kwargs or {}).items() if k in defaults}
    return wall_bound_s(_limits(**{**defaults, **given}))


def check_timeout_budget(specs, outer_timeout_s: float, outer_key: str = "reward.timeout_s",
                         spec_key: str = "reward.fns[{i}].kwargs.total_timeout_s") -> None:
    """Raise ValueError naming both keys when ``outer_timeout_s`` (the reward worker's hard per-call
    limit) is not longer than a ``code`` reward's own budget (see total_budget_s). ``specs``: anything
    ``rewards.as_spec`` takes (RewardSpec, ``(ref, weight, kwargs)``, dicts, ref strings)."""
    for i, raw in enumerate(specs):
        spec = as_spec(raw)
        if spec.ref not in _CODE_REFS:
            continue
        budget = total_budget_s(spec.kwargs)
        if outer_timeout_s <= budget:
            total = spec.kwargs.get("total_timeout_s", 20.0)
            raise ValueError(
                f"{outer_key} ({outer_timeout_s:g} s) must be longer than the code reward's own budget "
                f"({budget:g} s = {spec_key.format(i=i)} ({total:g} s) + {budget - float(total):g} s sandbox "
                f"start-up/clean-up): raise {outer_key} above {budget:g} or lower {spec_key.format(i=i)}, "
                "else slow but honest programs are killed as hung calls")
