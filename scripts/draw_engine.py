"""Draw the rollout engine, its clients and the runner seam as docs/img/engine.png (docs/architecture.md).

    python scripts/draw_engine.py [--out docs/img/engine.png]

Solid boxes are built; dashed boxes are the seam's planned implementations (docs/architecture.md says which).
"""
from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

CLIENTS = ["generate\n(rollout.decoder)", "TurnDriver: envs\n(rollout.multiturn)",
           "partial rollouts\n(rollout.partial)", "ebpo serve\n(EngineDriver)", "agent gateway\n(ebpo.serve.gateway)"]
ENGINE = ("Engine (rollout.engine): one per worker / server, for its whole life\n"
          "submit(prompt, generator, config) · extend · end/abort · drain/export/adopt · set_version\n"
          "queue -> admit into free slots -> ONE forward over the ready rows -> apply per row\n"
          "per-row settings: temperature, top-k/p, penalty, tau_mask/edit/delete/insert, MBE, EOS, length")
RUNNERS = [("EagerRunner (rollout.runner)\n+ shared prompt prefixes\n(rollout.prefix_share)", True),
           ("CompiledRunner\n(rollout.static_slots)", True),
           ("ParallelRunner, one rank\n(rollout.parallel_runner)", True),
           ("another backend\n(SGLang, once it samples)", False)]


def _box(ax, x, y, w, h, text, built=True, color="#dbe9f6", size=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", linewidth=1.2,
                                linestyle="-" if built else "--", facecolor=color if built else "white",
                                edgecolor="#1f4e79"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def _arrow(ax, x0, y0, x1, y1):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=10, color="#444444"))


def draw(out: str) -> None:
    fig, ax = plt.subplots(figsize=(11, 6.2))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    w = 2.0
    for i, name in enumerate(CLIENTS):
        x = 0.25 + i * 2.15
        _box(ax, x, 5.0, w, 0.8, name, color="#e8f4e0")
        _arrow(ax, x + w / 2, 5.0, x + w / 2, 4.35)
    ax.text(0.25, 5.95, "clients: submit, extend, end, drain", fontsize=9, style="italic")
    _box(ax, 0.25, 2.9, 10.5, 1.4, ENGINE, size=9)
    ax.text(0.25, 2.62, "runner seam (chosen once, rollout.runners): the model, the slots, the KV cache, ONE forward",
            fontsize=9, style="italic", bbox=dict(facecolor="white", edgecolor="none", pad=1))
    for i, (name, built) in enumerate(RUNNERS):
        x = 0.25 + i * 2.7
        _arrow(ax, x + 1.25, 2.9, x + 1.25, 2.1)
        _box(ax, x, 1.1, 2.5, 0.95, name, built, color="#dbe9f6")
    ax.text(0.25, 0.6, "solid: built; dashed: planned behind the same seam", fontsize=8)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/img/engine.png")
    draw(p.parse_args().out)


if __name__ == "__main__":
    main()
