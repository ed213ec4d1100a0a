"""`rg:` data sources through the real reasoning-gym package (the `envs` extra): rows are the library's own
entries, seeded, with the task's config; bad sources fail naming the problem."""
import pytest

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]')")

from ebpo.infra.data import DataError, load_rows  # noqa: E402
from ebpo.infra.task_libraries import parse_rg_source  # noqa: E402

TASKS = ["basic_arithmetic", "spell_backward", "gcd", "letter_counting", "chain_sum"]


@pytest.mark.parametrize("name", TASKS)
def test_rg_source_rows_are_the_librarys_entries(name):
    rows = load_rows(f"rg:{name}?size=6&seed=3")
    ref = list(reasoning_gym.create_dataset(name, size=6, seed=3))  # the library called directly
    assert [r["prompt"] for r in rows] == [e["question"] for e in ref]
    assert [r["answer"] for r in rows] == [str(e["answer"]) for e in ref]
    assert [r["metadata"] for r in rows] == [e["metadata"] for e in ref]
    assert load_rows(f"rg:{name}?size=6&seed=3") == rows  # seeded
    assert [r["prompt"] for r in load_rows(f"rg:{name}?size=6&seed=4")] != [r["prompt"] for r in rows]


def test_rg_source_passes_the_tasks_config():
    spec = "rg:basic_arithmetic?size=20&seed=0&min_terms=2&max_terms=2&operators=[+,-]&allow_parentheses=false"
    assert parse_rg_source(spec)[1]["operators"] == ["+", "-"]
    for r in load_rows(spec):
        assert r["metadata"]["num_terms"] == 2 and "*" not in r["prompt"] and "(" not in r["prompt"]


@pytest.mark.parametrize("spec,needle", [
    ("rg:basic_arithmetic?seed=0", "give size="),
    ("rg:basic_arithmetic?size=5", "give seed="),
    ("rg:basic_arithmetic?size=0&seed=0", "size must be an integer >= 1"),
    ("rg:basic_arithmetic?size=5&seed=0&junk", "must look like key=value"),
    ("rg:no_such_task?size=5&seed=0", "no_such_task"),
    ("rg:basic_arithmetic?size=5&seed=0&not_a_field=1", "not_a_field"),
    ("rg:?size=5&seed=0", "no reasoning-gym dataset name"),
])
def test_bad_rg_sources_fail_naming_the_problem(spec, needle):
    with pytest.raises(DataError, match=None) as e:
        load_rows(spec)
    assert needle in str(e.value)
