"""A verifiers environment whose rubric `eval`s the model's boxed answer, as careless third-party rubrics do:
the verifier sandbox must contain what the answer runs."""
import verifiers as vf
from datasets import Dataset


def load_environment():
    dataset = Dataset.from_list([{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(1, 5)])
    parser = vf.Parser(extract_fn=vf.extract_boxed_answer)

    def evaluated_answer_is_right(completion, answer, **kwargs) -> float:
        return float(eval(parser.parse_answer(completion) or "None") == int(answer))  # noqa: S307 - the point

    return vf.SingleTurnEnv(dataset=dataset, parser=parser,
                            rubric=vf.Rubric(funcs=[evaluated_answer_is_right], weights=[1.0], parser=parser))
