"""The test tree mirrors the packages (docs/development.md, "Where the tests live").

* Every public module of ebpo/, rollout/, rewards/ and kernels/ (not `__init__`, `__main__` or a `_private` module)
  has its tests in `tests/<mirror>/test_<module>.py`, or in a folder `tests/<mirror>/<module>/` when they are many:
  `ebpo/core/likelihood.py` -> `tests/core/test_likelihood.py` or `tests/core/likelihood/`,
  `rollout/engine.py` -> `tests/rollout/test_engine.py`. The exceptions are `EXEMPT` below, each with its reason,
  and an exemption that is no longer needed fails too, so the list only shrinks.
* No test file name, test name or docstring carries a work-item number (`test_x_mut40.py`, `test_y_40`,
  "(issue NN)" with a number): where a test came from is not part of its name.

Read from the file tree and the sources (nothing imported): milliseconds."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGES = ("ebpo", "rollout", "rewards", "kernels")

REORGANISING = "tests being reorganised in this change"
BENCHMARK = "a benchmark: timings, nothing to assert; `ebpo bench NAME --help` runs in tests/cli/test_cli.py"

# module -> why it has no test file named after it (one line each). A module that gets a test file leaves the list.
EXEMPT = {
    # benchmarks
    "ebpo/bench/agent.py": BENCHMARK,
    "ebpo/bench/agent_rl.py": BENCHMARK + " (the RL part of `ebpo bench agent`)",
    "ebpo/bench/decode_rl.py": BENCHMARK + " (`ebpo bench decode --rl-workload`)",
    "ebpo/bench/decode_routing.py": "covered through tests/bench/test_decode.py (`--block-routing`)",
    "ebpo/bench/kernels.py": BENCHMARK,
    "ebpo/bench/learner.py": BENCHMARK,
    "ebpo/bench/likelihood.py": BENCHMARK,
    "ebpo/bench/prefix.py": BENCHMARK,
    "ebpo/bench/released.py": "covered through tests/rollout/test_released_style.py (the released generate() loop)",
    "ebpo/bench/rewards.py": "tests/bench/test_bench_rewards.py, being written in this change",
    "ebpo/bench/serve.py": BENCHMARK,
    "ebpo/bench/slow_tools.py": "covered through tests/bench/test_partial.py and tests/rl/test_partial_collect.py",
    # command line
    "ebpo/cli/eval.py": "covered through tests/rl/test_prompts.py (`ebpo eval --env`) and tests/sft/test_evaluation.py",
    "ebpo/cli/export.py": "a gap: only `ebpo export --help` runs (tests/cli/test_cli.py)",
    # infrastructure, exercised by the trainers
    "ebpo/infra/distributed.py": "covered through the DeepSpeed tests of tests/rl/test_learner.py and tests/sft",
    "ebpo/infra/lora.py": "covered through tests/rl/test_learner_config.py and the LoRA runs of tests/sft/test_trainer.py",
    "ebpo/infra/plots.py": "covered through tests/rl/test_trainer.py (trainer.plots=true)",
    # model pieces checked through the whole model
    "ebpo/model/masks.py": "the references of tests/model/test_modeling_llada2_moe.py and tests/kernels/test_attention.py",
    "ebpo/model/parallel/layers.py": "covered through tests/model/parallel/test_model.py (against the one-process model)",
    "ebpo/model/parallel/moe.py": "covered through tests/model/parallel/test_model.py (against the one-process model)",
    "ebpo/model/streamed_save.py": "covered through tests/rl/test_weight_stream.py (the streamed export = save_pretrained)",
    # the RL driver's systems code, run end to end through real Ray actors
    "ebpo/rl/actors.py": "covered through the Ray runs of tests/rl (test_trainer.py, killed workers in test_async_loop.py)",
    "ebpo/rl/async_pipeline.py": "covered through tests/rl/test_async_loop.py (the loop's producer thread)",
    "ebpo/rl/checkpoints.py": "covered through the resume tests of tests/rl/test_trainer.py and test_async_loop.py",
    "ebpo/rl/cluster.py": "covered through the Ray runs of tests/rl (test_trainer.py, test_two_node_cluster.py)",
    "ebpo/rl/learner_actor.py": "covered through tests/rl/test_learner_group_ray.py (learner ranks as Ray actors)",
    "ebpo/rl/learner_steps.py": "covered through tests/rl/test_learner.py (the micro-step loop of every update)",
    "ebpo/rl/run_state.py": "split from ebpo/rl/setup.py in this change; covered through tests/rl/test_trainer.py",
    "ebpo/rl/setup.py": "covered through tests/rl/test_trainer.py and the start-up checks of tests/cli/test_train.py",
    "ebpo/rl/step_record.py": "split from ebpo/rl/step.py in this change; covered through tests/rl/test_trainer.py",
    "ebpo/rl/sync_loop.py": "covered through tests/rl/test_trainer.py (the default loop)",
    # Triton kernels: a GPU, or Triton's interpreter
    "kernels/decode_triton.py": "tests/kernels/test_kernels_gpu.py (GPU) and test_kernels_triton_interpret.py",
    "kernels/fp8_triton.py": "tests/kernels/test_kernels_gpu.py (GPU) and test_kernels_triton_interpret.py",
}

# test files or folders whose file names, test names and docstrings may carry work-item numbers, with why (none)
NAMES_EXEMPT: dict[str, str] = {}

WORK_ITEM_FILE = re.compile(r"_(mut|mt|dev)?\d+\.py$")  # test_engine_mut40.py, test_judge_40.py
WORK_ITEM_TEST = re.compile(r"(^|_)issue_?\d+|_(mut|mt|dev)\d+(_|$)|_\d{2,}$")  # test_x_40, test_issue_35_y
WORK_ITEM_TEXT = re.compile(r"\b[Ii]ssues?\s*#?\d+")  # "(issue 40)", "issue #12"


def public_modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if not any(part.startswith(("_", ".")) for part in rel.parts) and "assets" not in rel.parts:
                out.append(rel.as_posix())
    return out


def mirror(module: str) -> tuple[Path, str]:
    """(the test folder of `module`, its stem): ebpo/a/b.py -> (tests/a, b); rollout/b.py -> (tests/rollout, b)."""
    parts = Path(module).with_suffix("").parts
    inner = parts[1:] if parts[0] == "ebpo" else parts
    return TESTS.joinpath(*inner[:-1]), inner[-1]


def has_tests(module: str) -> bool:
    folder, stem = mirror(module)
    return (folder / f"test_{stem}.py").is_file() or any((folder / stem).glob("**/test_*.py"))


def checked_test_files() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py"))
            if not any(p.is_relative_to(ROOT / folder) for folder in NAMES_EXEMPT)]


def test_every_public_module_has_a_test_file_named_after_it():
    missing = [m for m in public_modules() if m not in EXEMPT and not has_tests(m)]
    want = [f"{m}: {mirror(m)[0].relative_to(ROOT)}/test_{mirror(m)[1]}.py (or a folder {mirror(m)[1]}/)"
            for m in missing]
    assert not missing, "modules without a test file named after them (or a reason in EXEMPT):\n" + "\n".join(want)


def test_every_exemption_is_still_needed():
    modules = set(public_modules())
    stale = [f"{m}: {'no such module' if m not in modules else 'has a test file now'}"
             for m in EXEMPT if m not in modules or has_tests(m)]
    assert not stale, "remove these from EXEMPT in tests/test_tests_layout.py:\n" + "\n".join(stale)
    assert all(reason.strip() for reason in EXEMPT.values())


def test_no_test_file_name_carries_a_work_item_number():
    bad = [p.relative_to(ROOT).as_posix() for p in checked_test_files() if WORK_ITEM_FILE.search(p.name)]
    assert not bad, "name these after the module they test:\n" + "\n".join(bad)


def test_no_test_name_or_docstring_carries_a_work_item_number():
    bad = []
    for path in checked_test_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                       ast.ClassDef))]
        for node in nodes:
            name = getattr(node, "name", "<module>")
            if name.startswith(("test", "Test")) and WORK_ITEM_TEST.search(name):
                bad.append(f"{path.relative_to(ROOT)}: test name {name}")
            doc = ast.get_docstring(node) or ""
            if WORK_ITEM_TEXT.search(doc):
                bad.append(f"{path.relative_to(ROOT)}: docstring of {name}: {WORK_ITEM_TEXT.search(doc).group(0)!r}")
    assert not bad, "work-item numbers in the tests:\n" + "\n".join(bad)


def test_the_checks_see_what_they_check():
    """The rules above read real trees: the packages have modules, the mirror maps them, the patterns match the
    names they forbid and not the ones they allow."""
    modules = public_modules()
    assert "ebpo/core/likelihood.py" in modules and "rollout/engine.py" in modules
    assert not any(Path(m).name.startswith("_") for m in modules)
    assert mirror("ebpo/core/likelihood.py") == (TESTS / "core", "likelihood")
    assert mirror("ebpo/model/parallel/layout.py") == (TESTS / "model" / "parallel", "layout")
    assert mirror("rewards/envs/api.py") == (TESTS / "rewards" / "envs", "api")
    assert has_tests("ebpo/core/algos.py") and has_tests("ebpo/core/likelihood.py")  # a file; a folder
    for name in ("test_engine_mut40.py", "test_x_mt40.py", "test_y_dev40.py", "test_judge_40.py"):
        assert WORK_ITEM_FILE.search(name), name
    for name in ("test_engine.py", "test_fp8_ops.py", "test_llada22_mini_recipe.py"):
        assert not WORK_ITEM_FILE.search(name), name
    for name in ("test_rules_40", "test_issue35_x", "test_issue_12_y", "test_y_mut40"):
        assert WORK_ITEM_TEST.search(name), name
    for name in ("test_flash_80gb_recipe_fits", "test_eps_1e_6", "test_accuracy_0", "test_block_sizes_0_and_minus_3",
                 "test_the_issue_example"):
        assert not WORK_ITEM_TEST.search(name), name
    assert WORK_ITEM_TEXT.search("pinned (issue 40)") and not WORK_ITEM_TEXT.search("the issue's example")
