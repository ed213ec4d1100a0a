"""The recorded configuration of a run directory: compared on resume, never overwritten."""
import pytest
import yaml

from ebpo.infra.config import ConfigError
from ebpo.infra.run_config import check_resume, config_changes, flatten, open_run_dir

RECORDED = {"name": "q", "model": "tiny-sft", "reward": {"fns": [{"fn": "math", "weight": 1.0}], "num_workers": 1},
            "learner": {"lr": 5e-5}, "trainer": {"steps": 30, "eval_size": 200, "resume": None}, "ray": {"num_cpus": 2}}


def _with(**changes):
    import copy

    cfg = copy.deepcopy(RECORDED)
    for dotted, value in changes.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def test_flatten_and_changes_against_a_plain_walk():
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1, {"e": 2}]}) == {"a.b": 1, "d": [1, {"e": 2}]}
    changes = config_changes(RECORDED, _with(learner__lr=1e-4, trainer__eval_size=8, learner__mu=2))
    assert changes == {"learner.lr": (5e-5, 1e-4), "learner.mu": (None, 2), "trainer.eval_size": (200, 8)}


def test_operational_changes_pass_and_learning_changes_need_naming():
    assert check_resume(RECORDED, _with(trainer__eval_size=8, ray__num_cpus=4, reward__num_workers=2), [])
    for change in ({"reward__fns": [{"fn": "format_boxed", "weight": 1.0}]}, {"learner__lr": 1.0},
                   {"model": "tiny-sft-mixed"}, {"trainer__steps": 40}):
        with pytest.raises(ConfigError) as err:
            check_resume(RECORDED, _with(**change), [])
        key = next(iter(change)).replace("__", ".")
        assert key in str(err.value) and "trainer.resume_changes" in str(err.value)
    # naming the key or a section that holds it accepts the change
    assert "learner.lr" in check_resume(RECORDED, _with(learner__lr=1.0), ["learner.lr"])
    assert "reward.fns" in check_resume(RECORDED, _with(reward__fns=[]), ["reward"])
    with pytest.raises(ConfigError):  # "learner.l" is not a section holding learner.lr
        check_resume(RECORDED, _with(learner__lr=1.0), ["learner.l"])


def test_resume_never_overwrites_and_records_accepted_changes(tmp_path):
    run = tmp_path / "run"
    open_run_dir(run, RECORDED, resume=False)
    original = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError):
        open_run_dir(run, _with(learner__lr=1.0), resume=True)
    assert (run / "config.yaml").read_text() == original and not (run / "config_changes.yaml").exists()
    open_run_dir(run, _with(learner__lr=1.0, trainer__eval_size=8), resume=True, allowed=["learner.lr"])
    open_run_dir(run, _with(learner__lr=1.0, trainer__eval_size=8), resume=True)  # in force now: no new entry
    assert (run / "config.yaml").read_text() == original
    log = yaml.safe_load((run / "config_changes.yaml").read_text())
    assert len(log) == 1 and log[0]["changes"] == {"learner.lr": {"recorded": 5e-5, "now": 1.0},
                                                   "trainer.eval_size": {"recorded": 200, "now": 8}}


def test_resume_of_a_folder_without_a_recorded_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config.yaml"):
        open_run_dir(tmp_path, RECORDED, resume=True)
    assert list(tmp_path.iterdir()) == []
