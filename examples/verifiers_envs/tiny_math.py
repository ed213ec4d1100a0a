"""A verifiers environment in the library's own convention: a module with `load_environment(...)` that returns a
`verifiers.SingleTurnEnv` (dataset + parser + rubric). Nothing in it is ebpo's.

The questions are the tiny model's held-out arithmetic (`examples/data/math_eval.jsonl`); the rubric gives 1.0
when the boxed answer (verifiers' own `extract_boxed_answer` parser) equals the row's answer. ebpo loads it
with `vf:examples/verifiers_envs/tiny_math.py` data sources and the `verifiers` reward (docs/rl.md, "Task
libraries"); `verifiers.load_environment("tiny_math")` loads it too when this folder is on the Python path.
"""
import json
from pathlib import Path

import verifiers as vf
from datasets import Dataset

DATA = Path(__file__).resolve().parents[1] / "data" / "math_eval.jsonl"


def load_environment(path: str = str(DATA), num_examples: int = 0) -> vf.Environment:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = rows[:num_examples] if num_examples else rows
    dataset = Dataset.from_list([{"question": r["prompt"], "answer": str(r["answer"])} for r in rows])
    parser = vf.Parser(extract_fn=vf.extract_boxed_answer)

    def boxed_answer_is_right(completion, answer, **kwargs) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer.strip())

    rubric = vf.Rubric(funcs=[boxed_answer_is_right], weights=[1.0], parser=parser)
    return vf.SingleTurnEnv(dataset=dataset, parser=parser, rubric=rubric)
