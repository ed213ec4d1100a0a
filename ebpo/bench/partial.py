"""`ebpo bench partial`: wall time per RL step, in one run, for the loops side by side: synchronous
(`trainer.max_staleness=0`), asynchronous (`max_staleness=1`), asynchronous with partial rollouts
(`trainer.partial_rollouts=true`, waiting for overdue groups), and the same dropping them
(`trainer.partial_overdue=drop`, not run by default).

    ebpo bench partial                                   # long-tail workload, 3 configurations x 6 steps x 2 rounds
    ebpo bench partial --workload slow-tools --slow-s 6  # the agent recipe with tools slow in some episodes
    ebpo bench partial --steps 8 --rounds 1              # one round: A B C
    ebpo bench partial --json docs/bench/partial_cpu.json   # also a PNG of the step times next to it

Long-tail workload (single turn): the tiny random model with its EOS logit raised (`eos_model`, written to a
temporary folder), sampled at temperature 1, so that response lengths are long-tailed up to `--max-new-tokens`.
Slow-tools workload (multi-turn): `--recipe` with the calculator of `ebpo.bench.slow_tools`, whose tool calls take
`--slow-s` in a `--slow-share` of the episodes. Without partial rollouts a step's rollout waits for the longest
of its prompts_per_step x group_size sequences. With them, a step trains on the first prompts_per_step groups to
finish, while `trainer.partial_extra_groups` more keep decoding and carry over, at a block boundary, under the
newer weights.

Per configuration: seconds per step between the loop's per-step logs (median and mean; step 1, which pays
start-up, is left out), seconds per prompts_per_step x group_size trained samples (equal work), trained
response tokens per second of wall time, the share of trained tokens decoded in an earlier step
(`partial/carried_token_share`, weighted by the step's tokens), the staleness distribution (share of trained
samples whose oldest block is k weight versions behind the learner, from `version_log`), the groups dropped
for lag (`partial/dropped`, sequences) and the tool seconds per trained episode.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name -> overrides
    "sync": ["trainer.max_staleness=0"],
    "max_staleness=1": ["trainer.max_staleness=1"],
    "max_staleness=1 + partial": ["trainer.max_staleness=1", "trainer.partial_rollouts=true"],
    "max_staleness=1 + partial (drop)": ["trainer.max_staleness=1", "trainer.partial_rollouts=true",
                                         "trainer.partial_overdue=drop"],
}
DEFAULT_CONFIGS = ["sync", "max_staleness=1", "max_staleness=1 + partial"]


def eos_model(out: str, boost: float) -> str:
    """The tiny random model (`preset:tiny@0`) with its EOS logit raised by about `boost` along the mean final
    hidden state, saved with its tokenizer to `out`; returns `out`. Larger boosts give shorter answers."""
    import torch

    from ebpo.model.loading import load_model, load_model_tokenizer

    model = load_model("preset:tiny@0")
    with torch.no_grad():
        h = model.model(torch.randint(2, 100, (4, 32), generator=torch.Generator().manual_seed(0)))
        mu = h.reshape(-1, h.shape[-1]).mean(0)
        model.lm_head.weight[model.config.eos_token_id] += boost * mu / mu.norm() ** 2
    model.save_pretrained(out)
    load_model_tokenizer("preset:tiny@0").save_pretrained(out)
    return out


def write_data(folder: Path, rows: int = 64) -> tuple[Path, Path]:
    """Prompts (jsonl) and a reward the random model earns unevenly (so that advantages are non-zero)."""
    data = folder / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {a}+{b}?", "answer": str(a + b)})
                              for a in range(rows // 8) for b in range(8)))
    reward = folder / "uneven.py"
    reward.write_text("def score(*, completion, **_):\n    return (len(completion) % 3) / 2\n")
    return data, reward


def staleness_counts(version_log: list, first_step: int) -> dict[int, int]:
    """Trained samples per lag (learner version - the sample's oldest block's version) over the updates of
    steps >= first_step; `version_log`: (step, learner version, [sample versions]) per update. Lags ascending."""
    counts: dict[int, int] = {}
    for step, learner_version, versions in version_log:
        if step < first_step:
            continue
        for v in versions:
            counts[learner_version - v] = counts.get(learner_version - v, 0) + 1
    return {lag: counts[lag] for lag in sorted(counts)}


def shares(counts: dict[int, int]) -> dict[int, float]:
    """{lag: count} -> {lag: share of all samples} ({} without samples)."""
    n = sum(counts.values())
    return {lag: c / n for lag, c in counts.items()}


def step_periods(stamps: dict[int, float]) -> list[float]:
    """Seconds per step from the wall-clock stamps taken as each step was logged ({step: perf_counter s}):
    stamps[k] - stamps[k-1] for every k after the first step stamped (which pays start-up)."""
    steps = sorted(stamps)
    return [stamps[b] - stamps[a] for a, b in zip(steps, steps[1:])]


def summarize(name: str, periods: list[float], history: list[dict], version_log: list, first_step: int) -> dict:
    """One configuration's row from its measured steps (`first_step` on): periods (s), per-step metrics and
    version log (see the module docstring for each number)."""
    later = [h for h in history if h["step"] >= first_step]
    tokens = [h.get("response_length/mean", 0.0) * h.get("train/samples", 0.0) for h in later]
    carried = sum(h.get("partial/carried_token_share", 0.0) * t for h, t in zip(later, tokens))
    wall = sum(periods)
    return {"config": name, "steps": len(periods), "period_median_s": statistics.median(periods),
            "period_mean_s": wall / len(periods), "periods_s": periods,
            "trained_tokens_per_s": sum(tokens) / wall, "trained_tokens_per_step": sum(tokens) / len(later),
            "carried_token_share": carried / max(sum(tokens), 1e-9),
            "staleness": shares(staleness_counts(version_log, first_step)),
            "staleness_counts": staleness_counts(version_log, first_step),
            "dropped": sum(h.get("partial/dropped", 0.0) for h in later),
            "trained_samples_per_step": sum(h.get("train/samples", 0.0) for h in later) / len(later),
            "tool_s_per_trajectory": statistics.mean(h.get("agent/tool_latency_s", 0.0) for h in later),
            "rollout_s": statistics.mean(h.get("timing_s/rollout", 0.0) for h in later),
            "update_s": statistics.mean(h.get("timing_s/update", 0.0) for h in later),
            "response_length_max": max(h.get("response_length/max", 0.0) for h in later)}


def run_config(name: str, recipe: str | None, base: list[str], steps: int, run_root: str) -> dict:
    """`steps` RL steps of the workload (`recipe`, None for none, and its `base` overrides) under configuration
    `name`; its summary row."""
    from ebpo.bench.agent_rl import fit_with_step_stamps
    from ebpo.infra.config import load_config
    from ebpo.rl.config import RLConfig
    from ebpo.rl.trainer import make_loop

    run_dir = tempfile.mkdtemp(prefix="run-", dir=run_root)
    cfg = load_config(RLConfig, recipe, [*base, *CONFIGS[name], f"trainer.steps={steps}", f"trainer.run_dir={run_dir}"])
    history, stamps, version_log = fit_with_step_stamps(make_loop(cfg))
    return summarize(name, step_periods(stamps), history, version_log, first_step=2)


def merge(rows: list[dict]) -> dict:
    """Rounds of one configuration pooled: periods, tokens and samples together (as one longer run would give
    them); rollout and update seconds step-weighted."""
    if len(rows) == 1:
        return rows[0]
    periods = [p for r in rows for p in r["periods_s"]]
    n = sum(r["steps"] for r in rows)
    out = dict(rows[0], steps=n, periods_s=periods, period_median_s=statistics.median(periods),
               period_mean_s=sum(periods) / len(periods), dropped=sum(r["dropped"] for r in rows),
               response_length_max=max(r["response_length_max"] for r in rows))
    tokens = sum(r["trained_tokens_per_step"] * r["steps"] for r in rows)
    out["trained_tokens_per_s"] = tokens / sum(periods)
    out["trained_tokens_per_step"] = tokens / n
    out["carried_token_share"] = sum(r["carried_token_share"] * r["trained_tokens_per_step"] * r["steps"]
                                     for r in rows) / max(tokens, 1e-9)
    for key in ("rollout_s", "update_s", "trained_samples_per_step", "tool_s_per_trajectory"):
        out[key] = sum(r[key] * r["steps"] for r in rows) / n
    lags = sorted({lag for r in rows for lag in r["staleness_counts"]})
    out["staleness_counts"] = {lag: sum(r["staleness_counts"].get(lag, 0) for r in rows) for lag in lags}
    out["staleness"] = shares(out["staleness_counts"])
    return out


def per_batch_s(row: dict, batch: int) -> float:
    """Wall seconds per `batch` trained samples (prompts_per_step x group_size): the step period at equal work.
    With trainer.partial_overdue=wait a step trains overdue groups beyond the quota, so its steps are larger and
    seconds per step alone would flatter the configurations that train less."""
    return row["period_mean_s"] * batch / max(row["trained_samples_per_step"], 1e-9)


def speedups(runs: list[dict], batch: int | None = None) -> dict[str, float]:
    """Ratios of seconds per step (median, and mean; with `batch`, also seconds per `batch` trained samples)
    between the configurations present: partial (wait, drop) vs max_staleness=1 alone, max_staleness=1 vs sync."""
    by = {r["config"]: r for r in runs}
    out = {}
    for slow, fast, key in (("max_staleness=1", "max_staleness=1 + partial", "partial_vs_s1"),
                            ("max_staleness=1", "max_staleness=1 + partial (drop)", "partial_drop_vs_s1"),
                            ("sync", "max_staleness=1", "s1_vs_sync")):
        if slow in by and fast in by:
            out[f"speedup_{key}"] = by[slow]["period_median_s"] / by[fast]["period_median_s"]
            out[f"speedup_{key}_mean"] = by[slow]["period_mean_s"] / by[fast]["period_mean_s"]
            if batch:
                out[f"speedup_{key}_per_batch"] = per_batch_s(by[slow], batch) / per_batch_s(by[fast], batch)
    return out


def table(res: dict):
    """The rich table of `res["runs"]` (one row per configuration)."""
    from rich.table import Table

    w = res["workload"]
    what = (f"up to {w['max_new_tokens']} tokens" if w["name"] == "long-tail" else
            f"tools {w['slow_s']:g} s in {w['slow_share']:.0%} of episodes, else {w['fast_s']:g} s")
    t = Table(title=f"RL step, {w['name']} workload ({w['prompts_per_step']} prompts x {w['group_size']}, {what}, "
                    f"{res['steps']} measured steps x {res['rounds']} round(s))")
    batch = w["prompts_per_step"] * w["group_size"]
    for col in ("configuration", "s/step median", "s/step mean", f"s per {batch} samples", "trained tok/s",
                "samples/step", "carried tokens",
                "staleness 0/1/2+", "dropped seqs", "tool s/traj", "rollout s", "update s"):
        t.add_column(col)
    for r in res["runs"]:
        st = {int(k): v for k, v in r["staleness"].items()}
        lag = f"{st.get(0, 0):.0%}/{st.get(1, 0):.0%}/{sum(v for k, v in st.items() if k >= 2):.0%}"
        t.add_row(r["config"], f"{r['period_median_s']:.2f}", f"{r['period_mean_s']:.2f}",
                  f"{per_batch_s(r, batch):.2f}",
                  f"{r['trained_tokens_per_s']:.0f}", f"{r['trained_samples_per_step']:.1f}",
                  f"{r['carried_token_share']:.0%}", lag, f"{r['dropped']:.0f}", f"{r['tool_s_per_trajectory']:.2f}",
                  f"{r['rollout_s']:.2f}", f"{r['update_s']:.2f}")
    return t


def plot(res: dict, path: str) -> None:
    """Per-step seconds of every configuration (a PNG at `path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in res["runs"]:
        ax.plot(range(1, len(r["periods_s"]) + 1), r["periods_s"], marker="o", label=r["config"])
    ax.set_xlabel("measured step")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def common(a) -> list[str]:
    """The overrides of both workloads: sizes, a cheap learner, nothing but the steps measured."""
    return [f"rollout.prompts_per_step={a.prompts}", f"rollout.group_size={a.group}",
            f"trainer.partial_extra_groups={a.extra}", "trainer.tracking=none", "trainer.progress=false",
            "trainer.plots=false", "trainer.save_every=0", "trainer.filter_zero_std=false", "data.eval=null",
            "trainer.dynamic_sampling=0", f"rollout.num_threads={a.threads}", "reward.num_workers=1",
            f"learner={{n_draws: {a.n_draws}, mu: 1, lr: {a.lr}}}", f"trainer.seed={a.seed}"]


def workload(a, model: str, data: Path, reward: Path) -> list[str]:
    """The overrides every configuration shares: the long-tail workload (module docstring)."""
    decode = (f"{{max_new_tokens: {a.max_new_tokens}, temperature: 1.0, max_batch: {a.max_batch}}}")
    return [f"model={model}", f"data.train={data}", f"reward.fns=[{{fn: '{reward}:score'}}]",
            f"rollout.decode={decode}", *common(a), *a.set]


def slow_tool_workload(a) -> list[str]:
    """The overrides every configuration shares: the slow-tool workload (module docstring)."""
    env = (f"{{max_turns: 3, timeout_s: 2.0, slow_s: {a.slow_s}, fast_s: {a.fast_s}, "
           f"slow_share: {a.slow_share}}}")
    return ["env.name=ebpo.bench.slow_tools:slow_calculator", f"env.kwargs={env}",
            "env.turns.max_workers=256", f"rollout.decode={{temperature: 1.0, max_batch: {a.max_batch}}}",
            *common(a), *a.set]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ebpo bench partial", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="measured RL steps per configuration and round (after a "
                                                        "warm-up step that is left out)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the configurations, interleaved (A B C A B C)")
    p.add_argument("--prompts", type=int, default=4, help="rollout.prompts_per_step")
    p.add_argument("--group", type=int, default=2, help="rollout.group_size")
    p.add_argument("--extra", type=int, default=4, help="trainer.partial_extra_groups (groups in flight beyond "
                                                        "the prompts_per_step a step trains on)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest answer (tokens)")
    p.add_argument("--max-batch", type=int, default=0, help="rollout.decode.max_batch (0: every sequence at once)")
    p.add_argument("--eos-boost", type=float, default=0.75, help="EOS logit raise of the tiny model (larger: shorter)")
    p.add_argument("--threads", type=int, default=1, help="rollout.num_threads (torch threads of the rollout worker)")
    p.add_argument("--lr", type=float, default=0.0,
                   help="learner.lr (default 0: the learner does its whole update, but the policy, and so the length "
                        "distribution, stays the same across steps and configurations)")
    p.add_argument("--n-draws", type=int, default=1, help="learner.n_draws (noise draws per sample: the update's cost)")
    p.add_argument("--workload", choices=["long-tail", "slow-tools"], default="long-tail",
                   help="long-tail: single-turn answers of long-tailed length; slow-tools: the agent recipe with "
                        "tools that are slow in some episodes (ebpo.bench.slow_tools)")
    p.add_argument("--recipe", default="recipes/quickstart_agent.yaml", help="slow-tools: the agent recipe")
    p.add_argument("--slow-s", type=float, default=4.0, help="slow-tools: seconds per tool call of a slow episode")
    p.add_argument("--fast-s", type=float, default=0.05, help="slow-tools: seconds per tool call of the others")
    p.add_argument("--slow-share", type=float, default=0.25, help="slow-tools: share of the episodes that are slow")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated configurations to run (default: {', '.join(DEFAULT_CONFIGS)}; all: "
                        f"{', '.join(CONFIGS)})")
    p.add_argument("--seed", type=int, default=0, help="trainer.seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override of every configuration (repeatable)")
    p.add_argument("--json", default=None, help="write the results here (and a PNG of the step times next to it)")
    a = p.parse_args(argv)
    from rich.console import Console

    names = [n.strip() for n in a.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; allowed: {list(CONFIGS)}")
    os.environ.setdefault("WANDB_MODE", "offline")
    root = tempfile.mkdtemp(prefix="ebpo-bench-partial-")
    if a.workload == "long-tail":
        recipe, base = None, workload(a, eos_model(os.path.join(root, "eos_model"), a.eos_boost), *write_data(Path(root)))
        described = {"model": f"preset:tiny@0, EOS logit +{a.eos_boost:g}", "max_new_tokens": a.max_new_tokens}
    else:
        recipe, base = a.recipe, slow_tool_workload(a)
        described = {"recipe": a.recipe, "slow_s": a.slow_s, "fast_s": a.fast_s, "slow_share": a.slow_share}
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(a.rounds):
        for name in names:
            rows[name].append(run_config(name, recipe, base, a.steps + 1, root))
            load.append(os.getloadavg()[0])
    runs = [merge(rows[name]) for name in names]
    res = {"bench": "partial", "machine": platform.machine(), "cpus": os.cpu_count(), "steps": a.steps,
           "rounds": a.rounds, "wall_s": time.perf_counter() - t0,
           "load_average_1min": {"min": min(load), "max": max(load), "samples": load},
           "workload": {"name": a.workload, **described, "prompts_per_step": a.prompts,
                        "group_size": a.group, "partial_extra_groups": a.extra, "max_batch": a.max_batch,
                        "temperature": 1.0, "lr": a.lr, "n_draws": a.n_draws,
                        "rollout_threads": a.threads, "overrides": a.set},
           "runs": runs, **speedups(runs, a.prompts * a.group)}
    Console(width=200).print(table(res))
    print("; ".join(f"{k}: {v:.2f}x" for k, v in speedups(runs, a.prompts * a.group).items()) +
          f"; load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs; {res['wall_s']:.0f} s in all")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
        try:
            plot(res, str(Path(a.json).with_suffix(".png")))
        except ImportError:  # matplotlib is optional
            pass
    return 0
