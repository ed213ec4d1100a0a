"""`ebpo train` (ebpo.cli.train) start-up errors: one line and exit status 2, nothing written, nothing overwritten.

Each case fails before Ray starts, so the tests run in-process."""
import json
import shutil
from pathlib import Path

import pytest

from ebpo.cli.train import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")


def _train(capsys, *overrides) -> tuple[int, str]:
    rc = main([RECIPE, "trainer.tracking=none", "trainer.progress=false", *overrides])
    err = capsys.readouterr().err
    return rc, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("ebpo train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def recorded_run(tmp_path):
    """A run directory as a finished run leaves it: a recorded config and a `latest` checkpoint pointer."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_1")
    from ebpo.infra.config import load_config, to_dict
    from ebpo.infra.run_config import open_run_dir
    from ebpo.rl.config import RLConfig

    open_run_dir(run, to_dict(load_config(RLConfig, RECIPE, [f"trainer.run_dir={run}"])), resume=False)
    return run


def test_a_bad_learner_key_leaves_no_run_directory(tmp_path, capsys):
    run = tmp_path / "fresh"
    rc, err = _train(capsys, f"trainer.run_dir={run}", "learner.lrr=1")
    assert rc == 2 and "learner.lrr" in _one_line(err)
    assert not run.exists()


def test_a_failed_resume_leaves_the_recorded_config_alone(recorded_run, capsys):
    before = (recorded_run / "config.yaml").read_text()
    rc, err = _train(capsys, f"trainer.resume={recorded_run}", "learner.lrr=1")
    assert rc == 2 and "learner.lrr" in _one_line(err)
    rc, err = _train(capsys, f"trainer.resume={recorded_run}", "reward.fns=[{fn: format_boxed}]")
    assert rc == 2 and "reward.fns" in _one_line(err) and "trainer.resume_changes" in err
    assert (recorded_run / "config.yaml").read_text() == before
    assert not (recorded_run / "config_changes.yaml").exists()


def test_missing_data_file_is_one_line(tmp_path, capsys):
    rc, err = _train(capsys, f"trainer.run_dir={tmp_path / 'r'}", f"data.train={tmp_path / 'nope.jsonl'}")
    assert rc == 2 and "nope.jsonl" in _one_line(err) and not (tmp_path / "r").exists()


def test_malformed_jsonl_names_file_line_and_column(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "Compute 1+1.", "answer": "2"})
    # line 2 is 15 characters long and breaks off after its comma: the error is at column 16, just past
    # the end of the text (not 17, past the newline)
    data.write_text(f"{good}\n{{\"prompt\": \"x\",\n")
    rc, err = _train(capsys, f"trainer.run_dir={tmp_path / 'r'}", f"data.train={data}")
    line = _one_line(err)
    assert rc == 2 and f"{data}:2:" in line and "(column 16)" in line, line


@pytest.mark.parametrize("fn, needle", [("no_such_reward", "no_such_reward"),
                                        ("{path}:missing", "missing"),
                                        ("{path}:raises", "raises")])
def test_reward_errors_are_one_line(tmp_path, capsys, fn, needle):
    path = tmp_path / "user_reward.py"
    path.write_text("def raises(*, completion):\n    raise RuntimeError('boom')\n")
    rc, err = _train(capsys, f"trainer.run_dir={tmp_path / 'r'}", f"reward.fns=[{{fn: '{fn.format(path=path)}'}}]")
    assert rc == 2 and needle in _one_line(err)
    assert not (tmp_path / "r").exists()
    shutil.rmtree(tmp_path / "r", ignore_errors=True)


@pytest.mark.parametrize("override, expected", [
    ("env.name=nope", "unknown environment 'nope'"),
    ("env.kwargs={bogus: 1}", "unexpected keyword argument 'bogus'"),
])
def test_a_bad_environment_stops_before_anything_is_written(tmp_path, capsys, override, expected):
    run = tmp_path / "agent"
    rc = main([str(ROOT / "recipes" / "quickstart_agent.yaml"), "trainer.tracking=none", "trainer.progress=false",
               f"trainer.run_dir={run}", override])
    err = capsys.readouterr().err
    assert rc == 2 and expected in _one_line(err)
    assert not run.exists()


@pytest.mark.parametrize("key, value", [("rollout.tensor_parallel", 3), ("rollout.expert_parallel", 3)])
def test_a_parallel_rollout_layout_the_model_cannot_split_is_refused(tmp_path, capsys, key, value):
    """The shipped model has 4 attention heads and 8 routed experts: 3 ranks split neither. `ebpo train` refuses
    in one line naming the key and the allowed values, before anything is written."""
    run = tmp_path / "run"
    rc, err = _train(capsys, f"{key}={value}", f"trainer.run_dir={run}")
    line = _one_line(err)
    assert rc == 2 and f"{key} = {value}" in line and "allowed: [1, 2, 4" in line
    assert not run.exists()


def test_a_parallel_rollout_layout_the_model_splits_passes_the_start_up_checks(tmp_path):
    """tensor_parallel=2, expert_parallel=2 splits the shipped model's 4 heads / 2 KV heads / 8 experts:
    `check` passes it (the run itself starts a `ParallelRolloutWorker`: tests/rl/test_cluster_parallel.py)."""
    from ebpo.infra.config import load_config
    from ebpo.rl.config import RLConfig
    from ebpo.rl.setup import check

    cfg = load_config(RLConfig, RECIPE, ["rollout.tensor_parallel=2", "rollout.expert_parallel=2",
                                         f"trainer.run_dir={tmp_path / 'run'}"])
    run = check(cfg)
    assert (run.cfg.rollout.tensor_parallel, run.cfg.rollout.expert_parallel) == (2, 2)
    assert not (tmp_path / "run").exists()
