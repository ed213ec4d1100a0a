"""examples/tasks/generate.py: deterministic, disjoint splits, reference answers verified independently."""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.tasks.generate import generate  # noqa: E402


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generator_is_deterministic_and_splits_are_disjoint(tmp_path):
    a = generate(tmp_path / "a", seed=3, n_train=300, n_eval=40, n_cpt=50, fact_repeats=0)
    b = generate(tmp_path / "b", seed=3, n_train=300, n_eval=40, n_cpt=50, fact_repeats=0)
    for pa, pb in zip(a, b):
        assert pa.read_bytes() == pb.read_bytes()
    for task in ("math", "code"):
        train = {r["prompt"] for r in rows(tmp_path / "a" / f"{task}_train.jsonl")}
        held = {r["prompt"] for r in rows(tmp_path / "a" / f"{task}_eval.jsonl")}
        assert len(train) == 300 and len(held) == 40 and not train & held


def test_reference_answers_are_right(tmp_path):
    generate(tmp_path, seed=1, n_train=200, n_eval=20, n_cpt=10)
    for r in rows(tmp_path / "math_train.jsonl"):
        assert r["response"].endswith("\\boxed{" + r["answer"] + "}")
        for lhs, rhs in re.findall(r"([0-9][0-9+\-*]*)=(\d+)", r["response"]):
            assert eval(lhs) == int(rhs), (lhs, rhs)  # every column step of the working is true
        m = re.fullmatch(r"Compute ([0-9]+[+\-*][0-9]+)\.", r["prompt"])
        if m:  # plain left-to-right evaluation with * first, written out by hand
            terms = re.findall(r"[+-]?\d+(?:\*\d+)?", m.group(1))
            total = 0
            for t in terms:
                parts = t.split("*")
                v = int(parts[0]) * (int(parts[1]) if len(parts) > 1 else 1)
                total += v
            assert str(total) == r["answer"]
    for r in rows(tmp_path / "code_train.jsonl"):
        name = re.match(r"Write ([a-z])\(x\): take x, ", r["prompt"]).group(1)
        assert r["response"].startswith(f"def {name}(x):\n    return ")
        assert all(t.startswith(f"assert {name}(") for t in r["tests"])
        ns = {}
        exec(r["response"], ns)
        for t in r["tests"]:
            exec(t, ns)  # raises AssertionError on a wrong reference


def test_worked_answers_follow_from_the_prompt_numbers(tmp_path):
    """Word problems: the answer is the sum / difference of the two numbers in the prompt."""
    generate(tmp_path, seed=2, n_train=300, n_eval=20, n_cpt=10)
    kinds = set()
    for r in rows(tmp_path / "math_train.jsonl"):
        a, b = (int(v) for v in re.findall(r"\d+", r["prompt"])[:2])
        if "finds" in r["prompt"]:
            kinds.add("find")
            assert int(r["answer"]) == a + b
        elif "gives away" in r["prompt"]:
            kinds.add("give")
            assert int(r["answer"]) == a - b >= 0
    assert kinds == {"find", "give"}


def test_fact_rows_cover_every_step_of_the_working_and_stay_out_of_eval(tmp_path):
    """Each column step of every two-digit training question is one of the fact questions, the facts are
    right (checked with eval), and no fact prompt is a held-out prompt."""
    generate(tmp_path, seed=4, n_train=500, n_eval=50, n_cpt=10, fact_repeats=2)
    train = rows(tmp_path / "math_train.jsonl")
    held = {r["prompt"] for r in rows(tmp_path / "math_eval.jsonl")}
    facts = [r for r in train if re.fullmatch(r"Compute \d(?:[+\-*]\d+)+\.|Compute 1\d-\d\.", r["prompt"])]
    fact_steps = {r["response"].split()[0] for r in facts}
    assert len(train) == 500 + 2 * len(fact_steps) and not held & {r["prompt"] for r in facts}
    for r in facts:
        lhs, rhs = r["response"].split()[0].split("=")
        assert eval(lhs) == int(rhs) == int(r["answer"])
    for r in train:
        if r not in facts:
            for step in re.findall(r"[0-9][0-9+\-*]*=\d+", r["response"]):
                assert step in fact_steps, (r["prompt"], step)
