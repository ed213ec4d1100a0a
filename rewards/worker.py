"""RewardWorker: scores samples with weighted rewards on a hard-timeout process pool.

A plain class; the trainer makes it a Ray actor with ``ray.remote(num_cpus=...)(RewardWorker)``.
"""
from __future__ import annotations

import warnings

from rewards.api import SAMPLE_FIELDS, RewardSpec, as_spec
from rewards.loader import BUILTINS, RewardLoadError, check_signature, is_batched, load_reward
from rewards.pool import Call, HardTimeoutPool, Outcome, execute

COUNTERS = ("reward/calls", "reward/timeouts", "reward/errors", "reward/skips", "reward/worker_restarts",
            "reward/program_tests", "reward/vacuous_tests", "reward/unsupported_tests")
# extras a reward may report that are summed into the counters (the code reward's residual programs,
# ignored tests, and tests the judge cannot run)
_COUNTED_EXTRAS = {"program_tests": "reward/program_tests", "vacuous_tests": "reward/vacuous_tests",
                   "unsupported_tests": "reward/unsupported_tests"}


def _fields(sample: dict, index: int) -> dict:
    if not isinstance(sample, dict) or "completion" not in sample:
        raise ValueError(f"sample {index} must be a dict with at least 'completion'; got "
                         f"{sorted(sample) if isinstance(sample, dict) else type(sample).__name__}")
    out = {k: sample.get(k) for k in SAMPLE_FIELDS}
    out["metadata"] = out["metadata"] or {}
    return out


def _warn_short_timeout(specs: list[RewardSpec], timeout_s: float) -> None:
    """A code reward whose own budget exceeds the hard per-call timeout would see slow honest programs
    killed as hung calls (a configuration check makes it an error with check_timeout_budget)."""
    from rewards.code_reward import check_timeout_budget
    try:
        check_timeout_budget(specs, timeout_s, outer_key="RewardWorker timeout_s",
                             spec_key="specs[{i}].kwargs.total_timeout_s")
    except ValueError as e:
        warnings.warn(str(e), stacklevel=3)


class RewardWorker:
    """Weighted sum of rewards per sample, each call under a hard wall-clock limit.

    specs: RewardSpec, ref strings, ``(ref, weight, kwargs)`` tuples or dicts.
    num_workers: worker processes (= calls in flight); 0 runs calls in this process without the hard
        timeout (debugging only).
    timeout_s: hard per-call limit; a call past it is killed and scores ``default_score``.
    default_score: score of a timed-out or failed reward call.
    mp_context: "spawn" (default) or "forkserver"; never "fork" (the trainer holds torch/Ray threads).
    """

    def __init__(self, specs, num_workers: int = 2, timeout_s: float = 30.0, default_score: float = 0.0,
                 mp_context: str = "spawn", batch_chunks: int | None = None):
        self.specs: list[RewardSpec] = [as_spec(s) for s in specs]
        if not self.specs:
            raise ValueError("RewardWorker needs at least one reward spec")
        names = [s.name for s in self.specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward names must be unique; set RewardSpec.name for {dup}")
        if mp_context == "fork":
            raise ValueError("mp_context='fork' is unsafe in a process holding threads; use spawn or forkserver")
        self._fns = {}
        for s in self.specs:  # import + signature errors surface here, in the caller's process
            fn = load_reward(s.ref)
            check_signature(fn, s.ref, s.kwargs)
            self._fns[s.ref] = fn
        self.timeout_s = float(timeout_s)
        self.default_score = float(default_score)
        self.num_workers = int(num_workers)
        self.batch_chunks = batch_chunks or max(1, self.num_workers)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._sandbox_mode = None
        if any(BUILTINS.get(s.ref) == BUILTINS["code"] for s in self.specs):
            from rewards.sandbox import resolve_mode
            self._sandbox_mode = resolve_mode(next(s.kwargs.get("sandbox", "auto") for s in self.specs
                                                   if BUILTINS.get(s.ref) == BUILTINS["code"])).mode
        if self.num_workers > 0:
            _warn_short_timeout(self.specs, self.timeout_s)
        self._pool = None
        if self.num_workers > 0:
            self._pool = HardTimeoutPool(self.num_workers, self.timeout_s, mp_context,
                                         preload=[s.ref for s in self.specs])
            try:
                self._pool.wait_ready()
            except BaseException:
                self._pool.close()
                raise

    # -- scoring -------------------------------------------------------------------------------------
    def _run(self, calls: list[Call]) -> list[Outcome]:
        if self._pool is None:
            return [execute(c, self._fns) for c in calls]
        before = self._pool.restarts
        outs = self._pool.run(calls)
        self._counters["reward/worker_restarts"] += self._pool.restarts - before
        return outs

    def score(self, samples: list[dict]) -> list[dict]:
        """Score samples (dicts with prompt, completion, answer, tests, metadata).

        Returns per sample: ``score`` (weighted sum; skipped rewards contribute nothing), ``rewards``
        (name -> float, None when skipped), ``extras`` (name -> that reward's extras), and flags
        ``timeout``, ``error``, ``skipped`` (any reward of the sample)."""
        fields = [_fields(s, i) for i, s in enumerate(samples)]
        calls, where = [], []  # where[k] = (spec index, sample indices of call k)
        for j, spec in enumerate(self.specs):
            if is_batched(self._fns[spec.ref]):
                size = -(-len(fields) // self.batch_chunks) or 1
                for a in range(0, len(fields), size):
                    calls.append(Call(spec.ref, spec.kwargs, fields[a:a + size], True))
                    where.append((j, list(range(a, min(a + size, len(fields))))))
            else:
                for i, f in enumerate(fields):
                    calls.append(Call(spec.ref, spec.kwargs, f))
                    where.append((j, [i]))
        outs = self._run(calls)
        results = [{"score": 0.0, "rewards": {}, "extras": {}, "timeout": False, "error": False,
                    "skipped": False} for _ in fields]
        for (j, idx), out in zip(where, outs):
            spec = self.specs[j]
            self._counters["reward/calls"] += 1
            for n, i in enumerate(idx):
                r = results[i]
                if out.status == "ok":
                    score, extras = out.value[n] if isinstance(out.value, list) else out.value
                else:
                    score, extras = self.default_score, {out.status: out.message}
                    r[out.status] = True
                if score is None:
                    r["skipped"] = True
                    self._counters["reward/skips"] += 1
                else:
                    r["score"] += spec.weight * score
                r["rewards"][spec.name] = score
                r["extras"][spec.name] = extras
                for key, counter in _COUNTED_EXTRAS.items():
                    if isinstance(extras, dict) and type(extras.get(key)) is int:
                        self._counters[counter] += extras[key]
            if out.status == "timeout":
                self._counters["reward/timeouts"] += len(idx)
            elif out.status == "error":
                self._counters["reward/errors"] += len(idx)
        return results

    def dry_run(self, row: dict) -> dict:
        """Score ``row`` once (completion = row["completion"] or ""); raise RewardLoadError naming the
        reward on any import, signature or call error, or a timeout."""
        sample = {k: row.get(k) for k in SAMPLE_FIELDS}
        sample["completion"] = row.get("completion") or ""
        calls = [Call(s.ref, s.kwargs, _fields(sample, 0)) if not is_batched(self._fns[s.ref])
                 else Call(s.ref, s.kwargs, [_fields(sample, 0)], True) for s in self.specs]
        for spec, out in zip(self.specs, self._run(calls)):
            if out.status != "ok":
                raise RewardLoadError(f"reward {spec.name!r} ({spec.ref}) failed its dry run on a dataset row "
                                      f"(keys {sorted(row)}): {out.status}: {out.message}")
        return self.score([sample])[0]

    def stats(self, reset: bool = False) -> dict:
        """Cumulative counters since construction (or since the last ``reset=True`` call), plus
        ``sandbox/mode`` when a code reward is configured. ``reward/program_tests``,
        ``reward/vacuous_tests`` and ``reward/unsupported_tests`` sum the code reward's extras."""
        out = dict(self._counters)
        if self._sandbox_mode:
            out["sandbox/mode"] = self._sandbox_mode
        if reset:
            self._counters = dict.fromkeys(COUNTERS, 0)
        return out

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

