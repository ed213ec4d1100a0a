"""`ebpo bench rewards`: math answers/s, code executions/s and reasoning-gym answers/s (`rg:` rows scored by
the `reasoning_gym` reward), serial vs the worker pool, and the cost of a hung call. Prints a table and
writes JSON with --json PATH."""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

HANG_FILE = "import time\n\ndef hang_reward(*, completion, **_):\n    if completion == 'hang':\n" \
            "        time.sleep(10_000)\n    return 1.0\n"


def _math_samples(n: int) -> list[dict]:
    out = []
    for i in range(n):
        a, b, c = 13 + i % 50, 3 + i % 7, i % 11
        gold = a * b + c
        comp = [f"So {a}*{b}+{c} = \\boxed{{{gold}}}", f"The answer is {gold + i % 2}",
                f"$\\frac{{{2 * gold}}}{{2}}$"][i % 3]
        out.append({"prompt": f"What is {a}*{b}+{c}?", "completion": comp, "answer": str(gold),
                    "tests": None, "metadata": {}})
    return out


def _code_samples(n: int) -> list[dict]:
    body = "```python\ndef add(a, b):\n    return a + b\n```"
    tests = [f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(5)]
    return [{"prompt": "add", "completion": body, "answer": None, "tests": tests, "metadata": {}}] * n


RG_TASKS = "basic_arithmetic,puzzle24,countdown,spell_backward,gcd"  # puzzle24, countdown: sympy-parsed answers


def _rg_samples(n: int, tasks: str) -> list[dict]:
    """`n` reasoning-gym rows over `tasks` (as `rg:` sources build them), half answered right (the gold
    answer in `<answer>` tags), half wrong; [] when reasoning-gym is not installed."""
    try:
        import reasoning_gym
    except ImportError:
        return []
    names = [t for t in tasks.split(",") if t]
    per = -(-n // len(names))
    out = []
    for name in names:
        for k, e in enumerate(reasoning_gym.create_dataset(name, size=per, seed=7)):
            pred = str(e["answer"]) if k % 2 == 0 else "7 + 7"
            out.append({"prompt": e["question"], "completion": f"thinking <answer>{pred}</answer>",
                        "answer": str(e["answer"]), "tests": None, "metadata": e["metadata"]})
    return out[:n]


def _rate(worker, samples, failures: list | None = None) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = worker.score(samples)
    dt = time.perf_counter() - t0
    if failures is not None:  # every sample is correct: say why one did not score 1
        failures += [r["extras"] for r in out if r["score"] != 1.0][:5 - len(failures)]
    return len(samples) / dt, sum(r["score"] for r in out) / len(out)


def main(argv: list[str]) -> int:
    from rewards import RewardWorker
    from rewards.sandbox import resolve_mode

    p = argparse.ArgumentParser(prog="ebpo bench rewards")
    p.add_argument("--math-n", type=int, default=600)
    p.add_argument("--code-n", type=int, default=60)
    p.add_argument("--rg-n", type=int, default=300, help="reasoning-gym answers (0: skip)")
    p.add_argument("--rg-tasks", default=RG_TASKS, help="comma-separated reasoning-gym task names")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=2.0, help="per-call timeout for the hung-call test")
    p.add_argument("--sandbox", default="auto")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    res: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                 "sandbox": resolve_mode(a.sandbox).mode, "workers": a.workers}
    math_s, code_s = _math_samples(a.math_n), _code_samples(a.code_n)
    rg_s = _rg_samples(a.rg_n, a.rg_tasks) if a.rg_n > 0 else []
    if a.rg_n > 0 and not rg_s:
        res["rg_skipped"] = "reasoning-gym is not installed (pip install -e '.[envs]')"
    code_spec = [("code", 1.0, {"sandbox": a.sandbox})]
    for label, n in (("serial", 0), ("pool", a.workers)):
        with RewardWorker(["math"], num_workers=n, timeout_s=30) as w:
            w.score(math_s[:20])  # warm-up: imports and sympy caches
            res[f"math_{label}_per_s"], res["math_mean_score"] = _rate(w, math_s)
        with RewardWorker(code_spec, num_workers=n, timeout_s=30) as w:
            w.score(code_s[:4])
            res[f"code_{label}_per_s"], res["code_mean_score"] = _rate(w, code_s, res.setdefault("code_failures", []))
        if rg_s:
            with RewardWorker(["reasoning_gym"], num_workers=n, timeout_s=30) as w:
                w.score(rg_s[:10])  # warm-up: imports (and the verifier sandbox's start)
                res[f"rg_{label}_per_s"], res["rg_mean_score"] = _rate(w, rg_s)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "hang.py")
        with open(path, "w") as f:
            f.write(HANG_FILE)
        with RewardWorker([f"{path}:hang_reward"], num_workers=a.workers, timeout_s=a.timeout) as w:
            batch = [{"completion": "ok"} for _ in range(40)]
            w.score(batch)
            t0 = time.perf_counter()
            w.score(batch)
            base = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = w.score(batch[:20] + [{"completion": "hang"}] + batch[20:])
            hung = time.perf_counter() - t0
            res.update(hang_timeout_s=a.timeout, hang_batch_s=hung, no_hang_batch_s=base,
                       hang_extra_s=hung - base, hang_flagged=sum(r["timeout"] for r in out),
                       hang_stats=w.stats())

    try:
        from rich.console import Console
        from rich.table import Table
        t = Table(title=f"rewards benchmark (sandbox={res['sandbox']}, workers={a.workers})")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in res.items():
            if not isinstance(v, dict):
                t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
        Console().print(t)
    except ImportError:
        print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
