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


def _template(prompt: str) -> str:
    """A prompt with its numbers, names and nouns abstracted: the kind of question it asks."""
    t = re.sub(r"\d+", "N", prompt)
    t = re.sub(r"Write \w+\(x\)", "Write F(x)", t)
    return re.sub(r"^\w+ has N \w+", "W has N T", re.sub(r"How many \w+\?", "How many T?", t))


def test_every_held_out_kind_of_question_is_also_trained(tmp_path):
    """The held-out split is a sample of the drawn prompts, not their first draws: kinds with few
    distinct prompts (code `take x, negate it`) used to land in the held-out split only."""
    generate(tmp_path, seed=0, n_train=3000, n_eval=200, n_cpt=10)
    for task in ("math", "code"):
        trained = {_template(r["prompt"]) for r in rows(tmp_path / f"{task}_train.jsonl")}
        missing = {_template(r["prompt"]) for r in rows(tmp_path / f"{task}_eval.jsonl")} - trained
        assert not missing, (task, sorted(missing)[:5])
    code = rows(tmp_path / "code_train.jsonl")
    assert any(not re.search(r"\d", r["response"].split("return")[1]) for r in code)  # constant-free ones


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


def test_shipped_model_knows_its_one_digit_facts():
    """The shipped tiny-sft, teacher-forced on held-out working: the first digit after each `=` (products
    included) is right for nearly all of them (it was 62% for the 2,000-step model it replaced). Later
    digits are probed too; they are the ones digits of two-digit results, where its misses are."""
    from examples.tasks.probe_facts import probe_facts
    from ebpo.model.loading import load_model, load_model_tokenizer

    held = rows(ROOT / "examples/data/math_eval.jsonl")[:30]
    found = probe_facts(load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft"), held)
    acc, mean_p, n = found["first"]
    assert n >= 50 and acc >= 0.9 and 0.8 <= mean_p <= 1.0, found
    # every column result of two or more digits has its later digits probed
    expected_later = sum(len(res) - 1 for r in held for res in __import__("re").findall(r"=(\d+)", r["response"]))
    assert found["later"][2] == expected_later > 0, found


def test_mixed_style_rows_keep_prompts_and_answers(tmp_path):
    """{math,code}_train_mixed.jsonl: the training rows in the same order, each response either unchanged or
    exactly its bare form (the boxed answer; the expression without `def`), about `bare_fraction` of them
    bare, reproducible from the seed. A bare code answer fails its own tests."""
    import pytest

    from examples.tasks.generate import mixed_style_rows

    generate(tmp_path / "a", seed=5, n_train=1000, n_eval=20, n_cpt=10, bare_fraction=0.3)
    generate(tmp_path / "b", seed=5, n_train=1000, n_eval=20, n_cpt=10, bare_fraction=0.3)
    for task in ("math", "code"):
        a = (tmp_path / "a" / f"{task}_train_mixed.jsonl").read_bytes()
        assert a == (tmp_path / "b" / f"{task}_train_mixed.jsonl").read_bytes()
        worked = rows(tmp_path / "a" / f"{task}_train.jsonl")
        mixed = rows(tmp_path / "a" / f"{task}_train_mixed.jsonl")
        assert len(worked) == len(mixed) == 1000
        bare = 0
        for w, m in zip(worked, mixed):
            assert {k: v for k, v in w.items() if k != "response"} == {k: v for k, v in m.items() if k != "response"}
            if m["response"] == w["response"]:
                continue
            bare += 1
            if task == "math":
                assert m["response"] == "\\boxed{" + w["answer"] + "}"
            else:
                assert w["response"].endswith("    return " + m["response"]) and "def" not in m["response"]
                with pytest.raises(NameError):  # run as the code reward runs it: x and the function are undefined
                    ns = {}
                    exec(m["response"], ns)
                    exec(m["tests"][0], ns)
        assert 240 <= bare <= 360, (task, bare)  # Binomial(1000, 0.3): mean 300, sd 14.5
    with pytest.raises(ValueError, match="bare_fraction"):
        mixed_style_rows(worked, 1.5, __import__("random").Random(0))
