from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from ebpo.infra.config import ConfigError, doc, load_config, parse_overrides


@dataclass
class Inner:
    lr: float = doc("learning rate", 1e-3)
    schedule: Literal["constant", "cosine"] = doc("LR schedule", "cosine")


@dataclass
class Outer:
    name: str = doc("run name", "x")
    steps: int = doc("steps", 3)
    seeds: list[int] = doc("seeds", default_factory=lambda: [1])
    tag: Optional[str] = doc("optional tag", None)
    inner: Inner = doc("inner section", default_factory=Inner)

    def validate(self):
        if self.steps < 0:
            raise ValueError("steps: must be >= 0")


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: run\ninner:\n  lr: 1e-4\n")
    cfg = load_config(Outer, p, ["inner.schedule=constant", "steps=7", "seeds=[3,4]", "tag=null"])
    assert (cfg.name, cfg.steps, cfg.seeds, cfg.tag) == ("run", 7, [3, 4], None)
    assert cfg.inner.lr == pytest.approx(1e-4) and cfg.inner.schedule == "constant"


@pytest.mark.parametrize("override,needle", [
    (["inner.lrr=1"], "unknown key 'inner.lrr'"),
    (["inner.schedule=linear"], "inner.schedule: 'linear' is not allowed; choose one of ['constant', 'cosine']"),
    (["steps=abc"], "steps: expected an integer"),
    (["steps=-1"], "steps: must be >= 0"),
    (["bogus=1"], "unknown key 'bogus'"),
    (["steps"], "must look like key=value"),
])
def test_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(Outer, None, override)
    assert needle in str(e.value)


def test_parse_overrides_nesting():
    assert parse_overrides(["a.b.c=1", "a.d=x"]) == {"a": {"b": {"c": 1}, "d": "x"}}


@dataclass
class WithKwargs:
    kwargs: dict = doc("factory keyword arguments", default_factory=dict)
    inner: Inner = doc("inner section", default_factory=Inner)


@pytest.mark.parametrize("clear", ["kwargs={}", "kwargs=null"])
def test_a_mapping_is_cleared_from_the_command_line(tmp_path, clear):
    p = tmp_path / "r.yaml"
    p.write_text("kwargs: {max_turns: 3, timeout_s: 2.0}\n")
    assert load_config(WithKwargs, p, [clear]).kwargs == {}
    # later overrides build on earlier ones: clear, then set one key
    assert load_config(WithKwargs, p, [clear, "kwargs.max_turns=5"]).kwargs == {"max_turns": 5}
    # a non-empty mapping still merges key by key, as before
    assert load_config(WithKwargs, p, ["kwargs={max_turns: 5}"]).kwargs == {"max_turns": 5, "timeout_s": 2.0}
    # an empty mapping on a section resets it to its defaults
    assert load_config(WithKwargs, None, ["inner.lr=0.5", "inner={}"]).inner == Inner()


def test_env_kwargs_of_the_agent_quickstart_can_be_cleared():
    from ebpo.rl.config import RLConfig

    recipe = "recipes/quickstart_agent.yaml"
    assert load_config(RLConfig, recipe).env.kwargs == {"max_turns": 3, "timeout_s": 2.0}
    for clear in ("env.kwargs={}", "env.kwargs=null"):
        assert load_config(RLConfig, recipe, [clear]).env.kwargs == {}
    assert load_config(RLConfig, recipe, ["env.kwargs=null", "env.kwargs.latency_s=1"]).env.kwargs == {"latency_s": 1}
