"""The built-in ``math`` reward: math-verify equivalence of the completion's answer with the gold answer.

Semantics (math-verify 0.9):
- gold: parsed as LaTeX or a plain expression; when that finds nothing (math-verify needs ``$..$`` for
  sets, intervals, roots) it is retried wrapped in ``$...$``, then in ``\\boxed{...}``. A gold answer that
  still parses to nothing scores *skip* (a data problem, not the model's fault).
- completion: LaTeX extraction first, where the last ``\\boxed{}`` wins over other LaTeX, then the
  last plain number/expression ("... gives 160." -> 160). Nothing extracted -> 0.
- verdict: ``verify(gold, answer)`` (gold first; it is not symmetric), floats compared at 6 digits,
  fractions/decimals/LaTeX/sets/intervals by sympy equivalence. Known false positives are listed in
  docs/rewards.md.
- time: math-verify's own ``signal.alarm`` timeouts work only on a main thread; they are used there
  (the reward worker processes call rewards on their main thread) and disabled elsewhere. Some sympy
  inputs hang in C code where no alarm fires: the RewardWorker's hard per-call kill bounds those.
"""
from __future__ import annotations

import math
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rewards.api import RewardResult, skip

_CFG = [LatexExtractionConfig(), ExprExtractionConfig()]


def _config():
    return _CFG


def _timeout(seconds: float):
    # signal.alarm raises off the main thread; there we rely on the caller's outer hard limit.
    # It takes whole seconds (a float raises TypeError).
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(seconds))


def parse_answer(text: str, timeout_s: float = 5.0, gold: bool = False) -> list:
    """math-verify parse of ``text``; for gold answers also try ``$text$`` and ``\\boxed{text}``."""
    t = _timeout(timeout_s)
    tries = [text, f"${text}$", f"\\boxed{{{text}}}"] if gold else [text]
    for candidate in tries:
        try:
            out = parse(candidate, extraction_config=_config(), parsing_timeout=t)
        except BaseException as e:  # math-verify's TimeoutException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            out = []
        if out:
            return out
    return []


def math_reward(*, completion: str, answer, timeout_s: float = 5.0, **_) -> RewardResult:
    """1.0 if the completion's extracted answer is equivalent to ``answer``, else 0.0; skip when the
    gold answer is missing or unparseable. extras: ``pred`` (matched text), ``gold`` (matched text)."""
    if answer is None or str(answer).strip() == "":
        return skip("no gold answer")
    gold = parse_answer(str(answer), timeout_s, gold=True)
    if not gold:
        return skip("gold answer unparseable", gold_raw=str(answer)[:200])
    pred = parse_answer(completion or "", timeout_s)
    extras = {"gold": str(gold[-1])[:200], "pred": str(pred[-1])[:200] if pred else None}
    if not pred:
        return RewardResult(0.0, extras)
    try:
        ok = verify(gold, pred, float_rounding=6, timeout_seconds=_timeout(timeout_s))
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        ok = False
        extras["verify_error"] = type(e).__name__
    return RewardResult(1.0 if ok else 0.0, extras)
