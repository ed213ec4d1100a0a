"""Loading environment factories by reference (rewards/envs/loader.py): the built-in names, `package.module:name`
and `path/file.py:name`; a bad reference is an EnvLoadError (a RewardLoadError) that names the problem."""
import textwrap

import pytest

from rewards.envs.calculator import calculator_env
from rewards.envs.code_repair import CodeRepairEnv
from rewards.envs.loader import BUILTIN_ENVS, EnvLoadError, load_environment, make_environment
from rewards.loader import RewardLoadError


def test_builtin_and_module_references_name_the_same_factory():
    assert sorted(BUILTIN_ENVS) == ["calculator", "code_repair"]  # the module docstring's built-ins
    assert load_environment("calculator") is calculator_env
    assert load_environment("code_repair") is CodeRepairEnv
    assert load_environment("rewards.envs.calculator:calculator_env") is calculator_env


def test_make_environment_calls_the_factory_with_the_recipe_kwargs(tmp_path):
    f = tmp_path / "envs_here.py"
    f.write_text(textwrap.dedent("""
        class Counter:
            def __init__(self, start=0):
                self.n = start
            def reset(self, row, seed=None):
                return None
            def step(self, turn):
                self.n += 1
                return (str(self.n), 0.0, False, {})

        def not_an_env(**kwargs):
            return object()

        VALUE = 3
    """))
    env = make_environment(f"{f}:Counter", {"start": 5})
    assert env.n == 5 and tuple(env.step("x")) == ("6", 0.0, False, {})
    assert make_environment(f"{f}:Counter").n == 0  # no kwargs: the factory's defaults
    assert make_environment("calculator", {"max_turns": 2}).max_turns == 2
    with pytest.raises(EnvLoadError, match="without a reset"):
        make_environment(f"{f}:not_an_env")
    with pytest.raises(EnvLoadError, match="no callable 'VALUE'"):
        load_environment(f"{f}:VALUE")


@pytest.mark.parametrize("ref, why", [("", "non-empty string"), (None, "non-empty string"),
                                      ("nope", "unknown environment"),
                                      ("no_such_pkg_xyz.mod:Env", "importing module 'no_such_pkg_xyz.mod'"),
                                      ("/nonexistent/env_file.py:Env", "does not exist")])
def test_a_bad_reference_is_an_env_load_error_naming_the_problem(ref, why):
    with pytest.raises(EnvLoadError, match=why) as e:
        load_environment(ref)
    assert isinstance(e.value, RewardLoadError)  # caught where reward references are
    assert not str(e.value).startswith("reward")  # it says environment, not reward
