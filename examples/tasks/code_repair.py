"""Deterministic generator of the tiny code-repair agent task: one-line Python functions with a missing or
an extra token, hidden tests, and synthetic trajectories that check a fix with the `run_tests` tool.

    python examples/tasks/code_repair.py --out examples/data        # the shipped files (seed 0)

Each question shows a buggy one-line function (`Fix the bug: def add_3(x): return x + 3 + 3`); the fix
is one token inserted or deleted, so a draft that copies the buggy line is off by a length change, the
case DELETE / INSERT edits are for. Bug families (`FAMILIES`; the fix follows from the function's name;
parameters are always `x`, `s, v` or `a, b`: the tiny model failed to copy random one-letter names, so
the variety is in the names' stems and digits, which it copies):

  * `extra_add`: a repeated `+ k` (`add_3`: `x + 3 + 3` -> `x + 3`): delete;
  * `extra_mul`: a repeated `* k` (`scale_4`: `x * 4 * 4` -> `x * 4`): delete;
  * `extra_not`: an extra `not` (`has`: `v not in s` -> `v in s`): delete;
  * `drop_not`: a dropped `not` (`lacks`: `v in s` -> `v not in s`): insert;
  * `drop_arg`: a missing argument (`bigger`: `max(a)` -> `max(a, b)`): insert.

Every row carries hidden `tests` (assert strings the sandboxed judge runs; the buggy function fails at
least one, the fixed one passes all). Writes

* `code_repair_train.jsonl`: rows `{"prompt", "answer" (the fixed function), "tests", "task", "bug",
  "style", "messages"}`, the messages a synthetic trajectory in the chat function-calling form. Styles:
  - `good`: `<tool_call>{"name":"run_tests","arguments":{"code":"FIXED"}}</tool_call>`, the tool's
    `passed 2/2`, then `done`;
  - `bad`: the buggy function sent unchanged, `failed: passed 0/2`, then `done` (gives up);
  - `retry`: the buggy function, the failure, then the fix, `passed 2/2`, `done`;
  - `none`: no call, the fixed function written as the answer (the environment scores 0: no verdict).
  The mix differs by phrasing (`--mix` for `Fix the bug: ...`, mostly good; `--mix-repair` for
  `Repair NAME: ...`, mostly no tool): the SFT model calls the tool for one phrasing and skips it for the
  other, so RL from the reward alone has room.
* `code_repair_eval.jsonl`: held-out rows `{"prompt", "answer", "tests", "task", "bug"}` whose questions
  never occur in training.

The tool's answers here are what `rewards.envs.code_repair` says for these calls (`tool_result`); the
test `tests/rewards/test_code_repair_env.py` checks that every style's observation is the sandbox's.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CALL = '<tool_call>{{"name":"run_tests","arguments":{{"code":"{code}"}}}}</tool_call>'
FAMILIES = ("extra_add", "extra_mul", "extra_not", "drop_not", "drop_arg")
PHRASES = ("Fix the bug: {buggy}", "Repair {name}: {buggy}")


def _list_tests(name: str, rng: random.Random, want_in: bool) -> list[str]:
    """Two asserts on `name(list, v)`: one value in the list, one not; `want_in`: the function says "v is in"."""
    xs = rng.sample(range(1, 10), 3)
    inside, outside = rng.choice(xs), rng.choice([v for v in range(1, 10) if v not in xs])
    return [f"assert {name}({xs}, {inside}) == {want_in}", f"assert {name}({xs}, {outside}) == {not want_in}"]


def make_problem(family: str, rng: random.Random) -> dict:
    """One problem of `family`: {"name", "buggy", "fixed", "tests", "bug"} (one-line functions)."""
    if family in ("extra_add", "extra_mul"):
        op, k = ("+", rng.randint(1, 9)) if family == "extra_add" else ("*", rng.randint(2, 9))
        stem = rng.choice(("add", "plus", "inc", "up") if op == "+" else ("scale", "times", "mul", "grow"))
        name, x = f"{stem}_{k}", "x"
        head = f"def {name}({x}): return {x} {op} {k}"
        xs = rng.sample(range(1, 20), 2)
        tests = [f"assert {name}({v}) == {v + k if op == '+' else v * k}" for v in xs]
        return {"name": name, "buggy": f"{head} {op} {k}", "fixed": head, "tests": tests, "bug": family}
    if family in ("extra_not", "drop_not"):
        s, v, d = "s", "v", rng.randint(1, 9)
        if family == "extra_not":
            name = f'{rng.choice(("has", "holds", "contains", "includes"))}_{d}'
            good, bad = f"{v} in {s}", f"{v} not in {s}"
        else:
            name = f'{rng.choice(("lacks", "misses", "excludes", "omits"))}_{d}'
            good, bad = f"{v} not in {s}", f"{v} in {s}"
        head = f"def {name}({s}, {v}): return "
        return {"name": name, "buggy": head + bad, "fixed": head + good,
                "tests": _list_tests(name, rng, family == "extra_not"), "bug": family}
    if family == "drop_arg":
        fn = rng.choice(("max", "min"))
        stem = rng.choice(("bigger", "larger", "top") if fn == "max" else ("smaller", "lower", "least"))
        name, a, b = f"{stem}_{rng.randint(1, 9)}", "a", "b"
        head = f"def {name}({a}, {b}): return {fn}({a}"
        p, q = rng.sample(range(1, 20), 2)
        tests = [f"assert {name}({p}, {q}) == {max(p, q) if fn == 'max' else min(p, q)}",
                 f"assert {name}({q}, {p}) == {max(p, q) if fn == 'max' else min(p, q)}"]
        return {"name": name, "buggy": head + ")", "fixed": head + f", {b})", "tests": tests, "bug": family}
    raise ValueError(f"family: choose one of {FAMILIES}, got {family!r}")


def tool_result(passed: int, total: int) -> str:
    """The `run_tests` tool's answer for `passed` of `total` hidden tests (the same text as
    `rewards.envs.code_repair.tool_result`; this script runs without the project installed)."""
    return f"passed {passed}/{total}" if passed == total else f"failed: passed {passed}/{total}"


def _call(code: str) -> dict:
    return {"role": "assistant", "content": CALL.format(code=json.dumps(code)[1:-1])}


def trajectory(problem: dict, prompt: str, style: str, failed_passes: int) -> list[dict]:
    """The messages of one synthetic trajectory of `style` (good | bad | retry | none) for `problem`.
    failed_passes: how many hidden tests the buggy function passes (what the tool answers to it)."""
    n = len(problem["tests"])
    msgs = [{"role": "user", "content": prompt}]
    ok = [_call(problem["fixed"]), {"role": "tool", "content": tool_result(n, n)}]
    fail = [_call(problem["buggy"]), {"role": "tool", "content": tool_result(failed_passes, n)}]
    done = [{"role": "assistant", "content": "done"}]
    if style == "good":
        return msgs + ok + done
    if style == "bad":
        return msgs + fail + done
    if style == "retry":
        return msgs + fail + ok + done
    if style == "none":
        return msgs + [{"role": "assistant", "content": problem["fixed"]}]
    raise ValueError(f"style: choose good, bad, retry or none, got {style!r}")


def buggy_passes(problem: dict) -> int:
    """How many of the problem's tests its buggy function passes (plain exec here: the generator's own code,
    trusted; the environment runs the model's code in the sandbox)."""
    n = 0
    for t in problem["tests"]:
        scope: dict = {}
        try:
            exec(problem["buggy"], scope)  # noqa: S102 - trusted generator code
            exec(t, scope)  # noqa: S102
            n += 1
        except Exception:  # noqa: BLE001 - a failing assert or a TypeError (max(a) on an int) is a failed test
            pass
    return n


def generate(out: str | Path, seed: int = 0, n_train: int = 6000, n_eval: int = 50,
             mix: tuple[float, ...] = (0.6, 0.15, 0.1, 0.15),
             mix_repair: tuple[float, ...] = (0.25, 0.15, 0.1, 0.5)) -> None:
    """Write code_repair_train.jsonl and code_repair_eval.jsonl under `out` (byte-identical for a seed).

    Families cycle row by row; half the questions use each phrasing (styles good / bad / retry / none drawn
    with `mix` for `Fix the bug:`, `mix_repair` for `Repair NAME:`)."""
    rng = random.Random(seed)
    seen, evals = set(), []
    while len(evals) < n_eval:
        p = make_problem(FAMILIES[len(evals) % len(FAMILIES)], rng)
        q = PHRASES[(len(evals) // len(FAMILIES)) % 2].format(**p)
        if p["buggy"] not in seen:
            seen.add(p["buggy"])
            evals.append({"prompt": q, "answer": p["fixed"], "tests": p["tests"], "task": "code_repair",
                          "bug": p["bug"]})
    train = []
    while len(train) < n_train:
        p = make_problem(FAMILIES[len(train) % len(FAMILIES)], rng)
        if p["buggy"] in seen:  # held out: no training question shows an evaluation function
            continue
        repair = (len(train) // len(FAMILIES)) % 2 == 1
        style = rng.choices(["good", "bad", "retry", "none"], weights=mix_repair if repair else mix)[0]
        q = PHRASES[repair].format(**p)
        train.append({"prompt": q, "answer": p["fixed"], "tests": p["tests"], "task": "code_repair",
                      "bug": p["bug"], "style": style, "messages": trajectory(p, q, style, buggy_passes(p))})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("code_repair_train.jsonl", train), ("code_repair_eval.jsonl", evals)):
        with (out / name).open("w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=6000)
    ap.add_argument("--n-eval", type=int, default=50)
    ap.add_argument("--mix", default="0.6,0.15,0.1,0.15",
                    help="`Fix the bug:` questions: fractions of good, bad, retry and no-tool trajectories")
    ap.add_argument("--mix-repair", default="0.25,0.15,0.1,0.5",
                    help="`Repair NAME:` questions: fractions of good, bad, retry and no-tool trajectories")
    a = ap.parse_args(argv)
    generate(a.out, a.seed, a.n_train, a.n_eval, tuple(float(x) for x in a.mix.split(",")),
             tuple(float(x) for x in a.mix_repair.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
