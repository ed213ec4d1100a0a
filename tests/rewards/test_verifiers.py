"""verifiers through the real package (the `envs` extra): `vf:` data sources are the environment's own dataset,
and the `verifiers` reward is the environment's rubric, checked against independent references."""
import asyncio
import json
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers", reason="the envs extra (pip install -e '.[envs]'; Python 3.11-3.13)")
reasoning_gym = pytest.importorskip("reasoning_gym")

from ebpo.infra.data import DataError, load_rows  # noqa: E402
from rewards import load_reward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_MATH = "examples/verifiers_envs/tiny_math.py"
RG_ENV = "tests/rewards/data/vf_reasoning_gym_env.py"


@pytest.fixture(autouse=True)
def repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def score(completion, row):
    return asyncio.run(load_reward("verifiers")(completion=completion, metadata=row["metadata"]))


def test_vf_rows_are_the_environments_dataset():
    rows = load_rows(f"vf:{TINY_MATH}?num_examples=5")
    ref = [json.loads(line) for line in (ROOT / "examples/data/math_eval.jsonl").read_text().splitlines()][:5]
    assert [r["prompt"] for r in rows] == [x["prompt"] for x in ref]
    assert [r["answer"] for r in rows] == [str(x["answer"]) for x in ref]
    assert all(r["metadata"]["verifiers"]["input"]["prompt"][-1] == {"role": "user", "content": r["prompt"]}
               for r in rows)
    assert len(load_rows(f"vf:{TINY_MATH}?limit=3")) == 3
    rg_rows = load_rows(f"vf:{RG_ENV}?split=eval")
    assert len(rg_rows) == 4 and len(load_rows(f"vf:{RG_ENV}")) == 8


def test_the_reward_is_the_rubric():
    rows = load_rows(f"vf:{TINY_MATH}?num_examples=4")
    for row in rows:
        assert score(f"working \\boxed{{{row['answer']}}}", row).score == 1.0
        assert score("\\boxed{-1}", row).score == 0.0 and score("no box", row).score == 0.0


def test_a_library_environment_scores_as_reasoning_gym_does():
    """verifiers.ReasoningGymEnv: its rubric parses <answer> tags and calls reasoning-gym's score_answer on the
    entry; the reference calls reasoning-gym directly on the same entries."""
    rows = load_rows(f"vf:{RG_ENV}")
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=12, seed=0))
    score_answer = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    for row, entry in zip(rows, entries):
        assert entry["question"] in row["metadata"]["verifiers"]["input"]["prompt"][-1]["content"]
        for pred in (entry["answer"], "12345", "x"):
            got = score(f"thinking... <answer>{pred}</answer>", row)
            assert got.score == pytest.approx(score_answer(pred, entry)), (pred, entry["answer"])


def test_bad_sources_and_rows():
    with pytest.raises(DataError, match="no_such_env"):
        load_rows("vf:no_such_env")
    with pytest.raises(DataError, match="split must be train or eval"):
        load_rows(f"vf:{TINY_MATH}?split=test")
    with pytest.raises(DataError, match="unexpected keyword"):
        load_rows(f"vf:{TINY_MATH}?not_an_arg=1")
    assert score("x", {"metadata": {"source_dataset": "gcd"}}).score is None  # not a verifiers row: skipped
    broken = {"metadata": {"verifiers": {"env": "tests/rewards/data/no_such_file.py", "env_args": {}, "input": {}}}}
    res = score("x", broken)
    assert res.score == 0.0 and "error" in res.extras  # an environment that fails costs the sample, not the run


def test_the_reward_reads_rows_as_the_rl_loop_passes_them():
    from ebpo.rl.prompts import reward_input

    for row in load_rows(f"vf:{TINY_MATH}?num_examples=3"):
        seen = reward_input(row, f"\\boxed{{{row['answer']}}}", "prompt")
        assert "verifiers" not in seen["metadata"]  # one level down, under the row's own metadata field
        assert score(seen["completion"], seen).score == 1.0
