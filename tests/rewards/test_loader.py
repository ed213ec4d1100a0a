"""The reward loader (rewards/loader.py): built-in names, `package.module:function` and `path/file.py:function`
references, errors that name the problem, and the call adapter (only declared fields; async awaited)."""
import os
import textwrap

import pytest

from rewards import RewardLoadError, load_reward
from rewards.loader import call_reward

HERE = os.path.dirname(os.path.abspath(__file__))
USER = os.path.join(HERE, "_user_rewards.py")


def test_builtins_load_by_name():
    for name in ("math", "code", "format", "format_boxed", "format_code"):
        assert callable(load_reward(name))


def test_module_and_file_references_load_the_same_function_body():
    by_module = load_reward("rewards.format_reward:format_boxed")
    assert by_module(completion="x \\boxed{1}").score == 1.0
    fn = load_reward(f"{USER}:length_reward")
    assert fn(completion="abcd") == 4.0


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(RewardLoadError, match="does not exist"):
        load_reward(str(tmp_path / "nope.py") + ":f")
    with pytest.raises(RewardLoadError, match="has no attribute 'missing'"):
        load_reward(f"{USER}:missing")
    with pytest.raises(RewardLoadError, match="unknown reward"):
        load_reward("not_a_builtin")
    with pytest.raises(RewardLoadError, match="importing module"):
        load_reward("no_such_pkg_xyz.mod:f")
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_abc\n")
    with pytest.raises(RewardLoadError, match="no_such_module_abc"):
        load_reward(f"{bad}:f")
    with pytest.raises(RewardLoadError, match="required parameter 'rubric'"):
        load_reward(f"{USER}:needs_unknown")
    pos = tmp_path / "pos.py"
    pos.write_text(textwrap.dedent("""
        def f(completion, /):
            return 1.0
    """))
    with pytest.raises(RewardLoadError, match="positional-only"):
        load_reward(f"{pos}:f")


def test_call_passes_only_declared_fields_and_awaits_async():
    fn = load_reward(f"{USER}:async_reward")
    out = call_reward(fn, {"prompt": "p", "completion": "7", "answer": "7", "tests": None, "metadata": {}},
                      {"scale": 2.0})
    assert out.score == 2.0 and out.extras == {"seen": "7"}
