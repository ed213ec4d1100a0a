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
    a = generate(tmp_path / "a", seed=3, n_train=300, n_eval=40, n_cpt=50)
    b = generate(tmp_path / "b", seed=3, n_train=300, n_eval=40, n_cpt=50)
    for pa, pb in zip(a, b):
        assert pa.read_bytes() == pb.read_bytes()
    for task in ("math", "code"):
        train = {r["prompt"] for r in rows(tmp_path / "a" / f"{task}_train.jsonl")}
        held = {r["prompt"] for r in rows(tmp_path / "a" / f"{task}_eval.jsonl")}
        assert len(train) == 300 and len(held) == 40 and not train & held


def test_reference_answers_are_right(tmp_path):
    generate(tmp_path, seed=1, n_train=200, n_eval=20, n_cpt=10)
    for r in rows(tmp_path / "math_train.jsonl"):
        assert r["response"] == "\\boxed{" + r["answer"] + "}"
        m = re.fullmatch(r"Compute ([0-9+\-*]+)\.", r["prompt"])
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
