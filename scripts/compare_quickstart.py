"""Bit-for-bit check of the RL driver: the quickstart's metrics at seed 0, short, in three configurations.

    python scripts/compare_quickstart.py record scripts/quickstart_baseline.json   # on the reference code
    python scripts/compare_quickstart.py compare scripts/quickstart_baseline.json  # after a change

Each configuration runs `python -m ebpo train recipes/quickstart.yaml` with overrides that keep it short
but still go through evaluation (steps 0, 2 and 3), checkpoints (every 2 steps and at the end, with
in-flight steps when asynchronous) and dynamic sampling: synchronous, asynchronous (trainer.max_staleness=1)
and two learner ranks (learner.num_workers=2). metrics.jsonl is compared minus wall-clock keys (time,
timing_s/*, perf/*), exactly: any difference in a float is a failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["trainer.steps=3", "trainer.eval_every=2", "trainer.eval_size=24", "trainer.save_every=2",
          "trainer.progress=false", "trainer.plots=false", "trainer.tracking=none", "rollout.prompts_per_step=8",
          "trainer.dynamic_sampling=2"]
CONFIGS = {
    "sync": [],
    "async_s1": ["trainer.max_staleness=1"],
    "two_learner_ranks": ["learner.num_workers=2"],
}
VOLATILE_PREFIXES = ("timing_s/", "perf/")
VOLATILE_KEYS = ("time",)


def stable(row: dict) -> dict:
    """One metrics.jsonl row without the keys that measure wall-clock time."""
    return {k: v for k, v in row.items() if k not in VOLATILE_KEYS and not k.startswith(VOLATILE_PREFIXES)}


def run_config(name: str, overrides: list[str]) -> list[dict]:
    """Runs the short quickstart with these overrides; returns its metrics.jsonl rows (stable keys only)."""
    with tempfile.TemporaryDirectory(prefix=f"ebpo-compare-{name}-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "ebpo", "train", "recipes/quickstart.yaml", *COMMON, *overrides,
               f"trainer.run_dir={run_dir}"]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"{name}: ebpo train failed with exit status {proc.returncode}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [stable(r) for r in rows]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    mode, path = argv[0], Path(argv[1])
    only = argv[2:] or list(CONFIGS)
    results = {name: run_config(name, CONFIGS[name]) for name in only}
    if mode == "record":
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"recorded {', '.join(results)} in {path}")
        return 0
    baseline = json.loads(path.read_text())
    failed = False
    for name, rows in results.items():
        want = baseline[name]
        if rows == want:
            print(f"{name}: identical ({len(rows)} rows)")
            continue
        failed = True
        print(f"{name}: DIFFERS")
        for i, (a, b) in enumerate(zip(want, rows)):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    print(f"  row {i} (step {a.get('step')}): {k}: baseline {a.get(k)!r} now {b.get(k)!r}")
        if len(want) != len(rows):
            print(f"  rows: baseline {len(want)} now {len(rows)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
