#!/usr/bin/env python3
"""`mutmut run` for scripts/mutation.py, with mutmut's fork runner waiting only for its own mutant runs.

The code reward's rlimits sandbox makes its calling process a child subreaper while it scores (so that its
judge's orphans can be reaped). When that happens in mutmut's in-process stats run, the orphans of every later
mutant's pytest come back to mutmut's main process, and mutmut 3.8.1's `os.wait()` takes one of them for a
mutant run (a KeyError ends the whole run). Here the wait skips any child that is not a running mutant. With a
mutmut whose runner lacks that method, this is plain `mutmut`.

    python scripts/mutmut_run.py run --max-children 1 [mutant names ...]
"""
import os
import sys
from datetime import datetime

from mutmut.workers import isolation


def _wait_for_result(self, timeout=None):
    if self._no_tests_results:
        return self._no_tests_results.pop(0)
    while True:
        pid, wait_status = os.wait()
        if pid in self._running:  # an orphan of the sandbox reaped here is not a mutant result
            break
    worker = self._running.pop(pid)
    return isolation.MutantResult(mutant_name=worker.mutant_name, exit_code=os.waitstatus_to_exitcode(wait_status),
                                  duration=(datetime.now() - worker.start_time).total_seconds())


if hasattr(getattr(isolation, "ForkRunner", None), "wait_for_result"):
    isolation.ForkRunner.wait_for_result = _wait_for_result

from mutmut.__main__ import cli  # noqa: E402  (after the patch: the runner is looked up when the run starts)

if __name__ == "__main__":
    sys.argv[0] = "mutmut"
    cli()
