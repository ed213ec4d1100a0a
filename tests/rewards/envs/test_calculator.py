"""The calculator environment (rewards/envs/calculator.py): safe arithmetic, the boxed answer as the task
reward, and loading it (and a user's environment file) by name."""
import pytest

from rewards.envs import EnvLoadError, StepResult, load_environment, make_environment
from rewards.envs.calculator import answer_matches, calc, calculator_env


def call(name, **args):
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def test_calculator_and_loader(tmp_path):
    assert calc("482*37") == str(482 * 37) and calc("(2+3)*4 - 7 // 2") == "17"
    for bad in ["__import__('os')", "2**999999", "1/0", "x"]:
        with pytest.raises((ValueError, SyntaxError, ZeroDivisionError)):
            calc(bad)
    env = load_environment("calculator")(max_turns=2)
    assert env.reset({"prompt": "Compute 482*37.", "answer": "17834"}) is None
    assert env.step(call("calc", expr="482*37")).observation == "17834"
    assert env.step("\\boxed{17834}").reward == 1.0
    assert answer_matches({"answer": "5"}, "\\boxed{6}") == 0.0
    f = tmp_path / "my_env.py"
    f.write_text("from rewards.envs import Environment, StepResult\n"
                 "class Echo(Environment):\n"
                 "    def step(self, turn):\n"
                 "        return StepResult(turn.upper(), 1.0, True)\n")
    env = make_environment(f"{f}:Echo")
    env.reset({})
    assert env.step("hi") == StepResult("HI", 1.0, True, {})
    with pytest.raises(EnvLoadError, match="no callable"):
        load_environment(f"{f}:Nope")
    with pytest.raises(EnvLoadError, match="unknown environment"):
        load_environment("nope")
    assert calculator_env().max_turns == 3
