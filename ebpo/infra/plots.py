"""PNG plots of a run's metrics (`metrics.jsonl`), written next to the run at the end."""
from __future__ import annotations

import json
import math
from pathlib import Path

PANELS = {
    "reward.png": ("Reward", ["reward/mean"]),
    "eval_accuracy.png": ("Held-out accuracy (greedy Quality Mode)", None),  # every eval/*/accuracy
    "response_length.png": ("Response length (tokens)", ["response_length/mean", "response_length/max"]),
    "tpf.png": ("Tokens per forward", ["decode/tpf"]),
    "timing.png": ("Seconds per stage", ["timing_s/rollout", "timing_s/reward", "timing_s/old_logprob",
                                         "timing_s/update", "timing_s/sync", "timing_s/step"]),
}


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics JSONL file (each has `step` and metric keys)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def plot_run(run_dir: str | Path, panels: dict = PANELS) -> list[Path]:
    """Write one PNG per panel into run_dir/plots/; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for filename, (title, keys) in panels.items():
        if keys is None:
            keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")})
        series = {}
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if pts:
                series[key] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for key, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=110)
        plt.close(fig)
        written.append(out_dir / filename)
    return written
