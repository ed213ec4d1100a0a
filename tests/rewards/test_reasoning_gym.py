"""The `reasoning_gym` reward through the real package (the `envs` extra): the task's own `score_answer` on
the extracted answer, robust to junk."""
import math

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]')")

from ebpo.infra.data import load_rows  # noqa: E402
from rewards import load_reward  # noqa: E402
from rewards.reasoning_gym_reward import extract_answer, reasoning_gym_score  # noqa: E402

TASKS = ["basic_arithmetic", "spell_backward", "gcd", "letter_counting", "chain_sum"]


@pytest.mark.parametrize("name", TASKS)
def test_the_reward_is_the_tasks_own_score_answer(name):
    fn = load_reward("reasoning_gym")  # the built-in name
    score_answer = reasoning_gym.get_score_answer_fn(name)
    for row in load_rows(f"rg:{name}?size=8&seed=11"):
        entry = {"question": row["prompt"], "answer": row["answer"], "metadata": row["metadata"]}
        for pred in (row["answer"], "7", "abc"):
            for completion in (f"working... \\boxed{{{pred}}}", f"<answer>{pred}</answer>", pred):
                got = fn(completion=completion, answer=row["answer"], metadata=row["metadata"], prompt=row["prompt"])
                assert got.score == float(score_answer(pred, entry)), (completion, row["answer"])
        assert fn(completion=f"\\boxed{{{row['answer']}}}", answer=row["answer"], metadata=row["metadata"],
                  prompt=row["prompt"]).score == 1.0


def test_extraction_order():
    assert extract_answer("\\boxed{1} then <answer> 2 </answer>") == "2"  # reasoning-gym's own tag first
    assert extract_answer("\\boxed{1} \\boxed{ 3 }") == "3"  # the last box
    assert extract_answer("  plain  ") == "plain" and extract_answer(None) == ""


def test_the_reward_is_robust():
    row = load_rows("rg:word_sorting?size=1&seed=0")[0]
    # a verifier that raises (word_sorting needs its metadata's sorted_words) gives 0.0, naming the error
    res = reasoning_gym_score(completion="\\boxed{a, b}", answer=row["answer"], metadata={"source_dataset": "word_sorting"})
    assert res.score == 0.0 and "KeyError" in res.extras["error"]
    # rows that are not reasoning-gym entries, or name no task it has, are skipped (score None), never raised
    assert reasoning_gym_score(completion="x", answer="1", metadata=None).score is None
    assert reasoning_gym_score(completion="x", answer="1", metadata={"source_dataset": "no_such_task"}).score is None
    # junk completions score what the task gives them, in [0, 1]
    for junk in ("", None, "\\boxed{", "x" * 100000, "<answer></answer>", "\x00\ufffd"):
        s = reasoning_gym_score(completion=junk, answer=row["answer"], metadata=row["metadata"], prompt=row["prompt"])
        assert s.score is not None and 0.0 <= s.score <= 1.0 and not math.isnan(s.score)


def test_ebpo_eval_scores_reasoning_gym_rows_with_the_tasks_verifier():
    from ebpo.sft.evaluation import score_rows, task_of

    rows = load_rows("rg:spell_backward?size=4&seed=2")
    right = [f"\\boxed{{{r['answer']}}}" for r in rows]
    # math-verify would call '\\boxed{12}' right for answer '12.0'; spell_backward's own verifier decides here
    wrong = [f"\\boxed{{{r['answer'][::-1]}}}" if r["answer"] != r["answer"][::-1] else "\\boxed{zz}" for r in rows]
    assert task_of(rows[0]) == "spell_backward"
    assert score_rows(rows, right) == [1.0] * 4 and score_rows(rows, wrong) == [0.0] * 4


def test_the_reward_reads_rows_as_the_rl_loop_passes_them():
    """The RL loop gives a reward the row's other fields as `metadata` (ebpo.rl.prompts.reward_input), so a
    reasoning-gym row's own metadata sits one level down."""
    from ebpo.rl.prompts import reward_input

    fn = load_reward("reasoning_gym")
    for row in load_rows("rg:basic_arithmetic?size=5&seed=4"):
        right = reward_input(row, f"\\boxed{{{row['answer']}}}", "prompt")
        wrong = reward_input(row, "\\boxed{x}", "prompt")
        assert fn(**{k: right[k] for k in ("completion", "answer", "metadata", "prompt")}).score == 1.0
        assert fn(**{k: wrong[k] for k in ("completion", "answer", "metadata", "prompt")}).score == 0.0
