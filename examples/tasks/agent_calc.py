"""Deterministic generator of the tiny agentic task: products too large for the tiny model, and a calculator.

    python examples/tasks/agent_calc.py --out examples/data        # the shipped files (seed 0)

Question: `Compute 482*37.` or `What is 482 times 37?` (a three-digit times a two-digit number, answer 4
to 5 digits). The tiny model
cannot multiply that in its head; the `calc` tool of `rewards.envs.calculator` can. Writes

* `agent_train.jsonl`: rows `{"prompt", "answer", "task": "agent_calc", "style", "messages"}`, the messages a
  synthetic trajectory in the chat function-calling form. Styles (fractions `--mix`):
  - `good`: `<tool_call>{"name":"calc","arguments":{"expr":"482*37"}}</tool_call>`, the tool's answer, then
    `\\boxed{ANSWER}`;
  - `bad`: a call with a wrong expression (one digit changed) whose result is boxed, or a malformed call
    (unknown tool, missing argument) answered by an error, then a guess;
  - `none`: no call, a guessed answer (wrong).
  The mix differs by phrasing (`--mix` for `Compute ...`, mostly good; `--mix-words` for `What is ...`,
  mostly no tool): it sets the SFT model's starting success (it calls the tool for one phrasing and
  guesses for the other), and RL from the reward alone can raise it.
* `agent_eval.jsonl`: held-out rows `{"prompt", "answer", "task"}` whose questions never occur in training.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CALL = '<tool_call>{{"name":"calc","arguments":{{"expr":"{expr}"}}}}</tool_call>'


def question(rng: random.Random) -> tuple[int, int]:
    return rng.randint(100, 999), rng.randint(11, 99)


def _typo(expr: str, rng: random.Random) -> str:
    """`expr` with one digit changed."""
    digits = [i for i, c in enumerate(expr) if c.isdigit()]
    i = rng.choice(digits)
    new = rng.choice([d for d in "0123456789" if d != expr[i] and not (i == 0 and d == "0")])
    return expr[:i] + new + expr[i + 1:]


def _guess(a: int, b: int, rng: random.Random) -> int:
    """A wrong answer of about the right size (what a model that cannot multiply writes)."""
    ans = a * b
    while True:
        g = round(ans * rng.uniform(0.8, 1.2))
        if g != ans:
            return g


def trajectory(a: int, b: int, style: str, rng: random.Random) -> list[dict]:
    """The messages of one synthetic trajectory of `style` (good | bad | none) for `a*b`."""
    expr, q = f"{a}*{b}", f"Compute {a}*{b}."
    msgs = [{"role": "user", "content": q}]
    if style == "good":
        return msgs + [{"role": "assistant", "content": CALL.format(expr=expr)}, {"role": "tool", "content": str(a * b)},
                       {"role": "assistant", "content": f"\\boxed{{{a * b}}}"}]
    if style == "none":
        return msgs + [{"role": "assistant", "content": f"\\boxed{{{_guess(a, b, rng)}}}"}]
    kind = rng.choice(["typo", "typo", "unknown", "missing"])
    if kind == "typo":
        wrong = _typo(expr, rng)
        x, y = (int(v) for v in wrong.split("*"))
        return msgs + [{"role": "assistant", "content": CALL.format(expr=wrong)}, {"role": "tool", "content": str(x * y)},
                       {"role": "assistant", "content": f"\\boxed{{{x * y}}}"}]
    if kind == "unknown":
        call = f'<tool_call>{{"name":"mul","arguments":{{"expr":"{expr}"}}}}</tool_call>'
        err = "error: unknown tool 'mul'"
    else:
        call = f'<tool_call>{{"name":"calc","arguments":{{"x":"{expr}"}}}}</tool_call>'
        err = "error: missing argument 'expr'"
    return msgs + [{"role": "assistant", "content": call}, {"role": "tool", "content": err},
                   {"role": "assistant", "content": f"\\boxed{{{_guess(a, b, rng)}}}"}]


PHRASES = ("Compute {a}*{b}.", "What is {a} times {b}?")


def generate(out: str | Path, seed: int = 0, n_train: int = 6000, n_eval: int = 200,
             mix: tuple[float, float, float] = (0.7, 0.15, 0.15),
             mix_words: tuple[float, float, float] = (0.4, 0.15, 0.45)) -> None:
    """Write agent_train.jsonl and agent_eval.jsonl under `out` (byte-identical for a seed).

    Half the questions are phrased `Compute a*b.` (styles good / bad / none drawn with `mix`), half `What is a
    times b?` (drawn with `mix_words`): the SFT model learns to call the tool mostly for the first phrasing
    and mostly to guess for the second, so its greedy success is about half of what calling the tool every
    time gives, and RL from the reward alone can carry the tool use over to the second phrasing."""
    rng = random.Random(seed)
    seen, evals = set(), []
    while len(evals) < n_eval:
        a, b = question(rng)
        if (a, b) not in seen:
            seen.add((a, b))
            q = PHRASES[len(evals) % 2].format(a=a, b=b)
            evals.append({"prompt": q, "answer": str(a * b), "task": "agent_calc"})
    train = []
    while len(train) < n_train:
        a, b = question(rng)
        if (a, b) in seen:
            continue
        words = len(train) % 2 == 1
        style = rng.choices(["good", "bad", "none"], weights=mix_words if words else mix)[0]
        msgs = trajectory(a, b, style, rng)
        msgs[0]["content"] = PHRASES[words].format(a=a, b=b)
        train.append({"prompt": msgs[0]["content"], "answer": str(a * b), "task": "agent_calc", "style": style,
                      "messages": msgs})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("agent_train.jsonl", train), ("agent_eval.jsonl", evals)):
        with (out / name).open("w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=6000)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--mix", default="0.7,0.15,0.15",
                    help="`Compute a*b.` questions: fractions of good, bad and no-tool trajectories")
    ap.add_argument("--mix-words", default="0.4,0.15,0.45",
                    help="`What is a times b?` questions: fractions of good, bad and no-tool trajectories")
    a = ap.parse_args(argv)
    generate(a.out, a.seed, a.n_train, a.n_eval, tuple(float(x) for x in a.mix.split(",")),
             tuple(float(x) for x in a.mix_words.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
