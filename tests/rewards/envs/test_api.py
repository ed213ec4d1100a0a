"""The environment interface (rewards/envs/api.py): what `step` may return and how it is read."""
import pytest

from rewards.envs.api import Environment, StepResult, as_step_result


def test_a_step_result_unpacks_as_the_four_tuple():
    obs, reward, done, info = StepResult("seen", 0.5, True, {"k": 1})
    assert (obs, reward, done, info) == ("seen", 0.5, True, {"k": 1})
    assert tuple(StepResult()) == (None, 0.0, False, {})  # the defaults: no observation, no reward, not done
    assert StepResult().info is not StepResult().info  # each result its own info


def test_step_values_of_each_documented_form_read_the_same():
    want = StepResult("obs", 1.0, True, {"a": 1})
    for value in (want, ("obs", 1.0, True, {"a": 1}), ["obs", 1, 1, {"a": 1}],
                  {"observation": "obs", "reward": 1, "done": True, "info": {"a": 1}}):
        got = as_step_result(value)
        assert got == want and type(got.reward) is float and type(got.done) is bool, value
    # a dict needs only observation and done; reward and info default; a None reward or info is 0.0 / {}
    assert as_step_result({"observation": None, "done": False}) == StepResult(None, 0.0, False, {})
    assert as_step_result((None, None, 0, {})) == StepResult(None, 0.0, False, {})
    assert as_step_result({"observation": None, "done": 0, "info": None}) == StepResult(None, 0.0, False, {})


@pytest.mark.parametrize("value, why", [("text", "returned str"), ((1, 2, 3), "returned tuple"),
                                        ({"observation": "x"}, "returned dict"), (None, "returned NoneType"),
                                        ((7, 0.0, False, {}), "observation must be str or None"),
                                        (("x", 0.0, False, []), "info must be a dict")])
def test_anything_else_is_a_type_error(value, why):
    with pytest.raises(TypeError, match=why):
        as_step_result(value)


def test_the_base_class_keeps_the_row_and_leaves_step_to_subclasses():
    env = Environment()
    assert env.max_turns is None and env.reset({"prompt": "p"}, seed=3) is None and env.row == {"prompt": "p"}
    with pytest.raises(NotImplementedError):
        env.step("turn")
    assert env.close() is None
