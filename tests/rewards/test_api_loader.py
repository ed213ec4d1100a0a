import os
import textwrap

import pytest

from rewards import RewardLoadError, RewardResult, RewardSpec, as_spec, load_reward, normalize
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


def test_normalize_and_specs():
    assert normalize(1, "r") == (1.0, {})
    assert normalize(None, "r") == (None, {})
    assert normalize(RewardResult(0.5, {"a": 1}), "r") == (0.5, {"a": 1})
    assert normalize({"score": 0.25, "why": "x"}, "r") == (0.25, {"why": "x"})
    with pytest.raises(TypeError, match="r returned str"):
        normalize("1", "r")
    with pytest.raises(ValueError, match="non-finite"):
        normalize(float("nan"), "r")
    assert as_spec(("math", 2.0, {"timeout_s": 3})) == RewardSpec("math", 2.0, {"timeout_s": 3}, "math")
    assert as_spec("pkg.mod:fn").name == "fn"
    with pytest.raises(ValueError, match="weight"):
        RewardSpec("math", float("inf"))
    with pytest.raises(ValueError, match="ref"):
        as_spec({"weight": 1})


def test_format_rewards():
    fb, fc, f = load_reward("format_boxed"), load_reward("format_code"), load_reward("format")
    assert fb(completion="so \\boxed{\\frac{1}{2}}").score == 1.0
    assert fb(completion="so \\boxed{}").score == 0.0
    assert fb(completion="so \\boxed{12").score == 0.0
    assert fb(completion="160").score == 0.0
    assert fc(completion="```python\nprint(1)\n```").score == 1.0
    assert fc(completion="```\nprint(1)\n```").score == 1.0
    assert fc(completion="```rust\nfn main(){}\n```").score == 0.0
    assert fc(completion="print(1)").score == 0.0
    assert f(completion="```py\nx=1\n```", kind="code").score == 1.0
    with pytest.raises(ValueError, match="kind"):
        f(completion="", kind="nope")


def test_rewards_imports_nothing_else_of_ours():
    import subprocess
    import sys
    code = ("import sys, rewards, rewards.code_reward, rewards.math_reward; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ebpo', 'rollout', 'kernels')]; "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(HERE))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
