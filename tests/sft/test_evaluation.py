"""ebpo.sft.evaluation: task inference, balanced subsets, scoring with the rewards, decoding through rollout."""
import pytest
import torch

from ebpo.sft.evaluation import EvalResult, balanced_subset, boxed_answer, score_rows, task_of


def test_task_of_and_balanced_subset():
    rows = [{"answer": "1"}] * 5 + [{"tests": ["assert True"]}] * 5
    assert task_of(rows[0]) == "math" and task_of(rows[-1]) == "code" and task_of({"task": "x"}) == "x"
    sub = balanced_subset(rows, 4)
    assert [task_of(r) for r in sub] == ["math", "code", "math", "code"]
    assert len(balanced_subset(rows, 0)) == 10
    with pytest.raises(ValueError, match="neither"):
        task_of({"prompt": "p"})


def test_boxed_answer():
    assert boxed_answer("so \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert boxed_answer("\\boxed{12") is None and boxed_answer("12") is None


def test_score_rows_math_and_code():
    rows = [{"answer": "160", "task": "math"}, {"answer": "7", "task": "math"},
            {"tests": ["assert f(2)==7", "assert f(0)==1"], "task": "code"},
            {"tests": ["assert f(2)==7", "assert f(0)==1"], "task": "code"}]
    completions = ["\\boxed{160}", "\\boxed{8}", "def f(x):\n    return x*3+1", "def f(x):\n    return x*3"]
    assert score_rows(rows, completions) == [1.0, 0.0, 1.0, 0.0]  # the second function fails one test


def test_eval_result_metrics():
    r = EvalResult("speed", ["math", "math", "code"], [1.0, 0.0, 1.0], tokens=30, forwards=12, edits=3, wall_s=1.0)
    m = r.metrics("eval/speed/")
    assert m["eval/speed/math/accuracy"] == 0.5 and m["eval/speed/code/accuracy"] == 1.0
    assert m["eval/speed/tpf"] == 2.5 and m["eval/speed/edits_per_seq"] == 1.0
    assert abs(m["eval/speed/accuracy"] - 2 / 3) < 1e-9


def test_evaluate_rows_runs_the_decoder():
    pytest.importorskip("rollout")
    from ebpo.sft.evaluation import decode_config, evaluate_rows
    from ebpo.model import LLaDA2MoeModelLM, tiny_config
    from ebpo.model.tokenizer import load_tokenizer

    assert decode_config("speed_noedit").editing is False and decode_config("speed").editing is True
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config())
    rows = [{"prompt": "Compute 1+2.", "answer": "3", "task": "math"}] * 2
    res = evaluate_rows(model, load_tokenizer(), rows, preset="quality", decode={"max_new_tokens": 8})
    assert len(res.correct) == 2 and res.forwards >= 2 and 0 < res.tpf <= 8
    assert res.samples[0]["completion"] == res.samples[1]["completion"]  # greedy: same prompt, same output
