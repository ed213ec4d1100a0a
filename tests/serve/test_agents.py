"""ebpo.serve.agents: loading an agent function from a recipe's `env.agent` reference (module docstring).

The agent RL runs themselves (AgentRolloutWorker through real trainers) are in tests/rl/test_agent_function_rl.py."""
import asyncio

import pytest

from ebpo.serve.agents import AgentLoadError, load_agent

AGENTS = '''
async def agent(client, row, max_turns=3, bonus=0.0):
    return {"client": client, "row": row, "max_turns": max_turns, "bonus": bonus}

def plain(client, row):
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture()
def agents_file(tmp_path):
    path = tmp_path / "my_agents.py"
    path.write_text(AGENTS)
    return str(path)


def test_a_file_reference_loads_the_async_function(agents_file):
    fn = load_agent(f"{agents_file}:agent")
    assert asyncio.run(fn("c", {"p": 1})) == {"client": "c", "row": {"p": 1}, "max_turns": 3, "bonus": 0.0}


def test_kwargs_are_bound_and_checked_against_the_signature(agents_file):
    fn = load_agent(f"{agents_file}:agent", {"max_turns": 5, "bonus": 0.5})
    assert asyncio.run(fn("c", "r")) == {"client": "c", "row": "r", "max_turns": 5, "bonus": 0.5}
    assert asyncio.run(load_agent(f"{agents_file}:agent", {})("c", "r"))["max_turns"] == 3
    with pytest.raises(AgentLoadError) as e:
        load_agent(f"{agents_file}:agent", {"turns": 2})
    assert str(e.value).startswith(f"env.agent '{agents_file}:agent': env.kwargs {{'turns': 2}} do not fit its "
                                   "signature: ")


def test_a_module_reference_loads_too():
    fn = load_agent("asyncio:sleep")  # any importable async function
    assert asyncio.run(fn(0, "done")) == "done"


@pytest.mark.parametrize("ref", ["no_colon", None, 3])
def test_a_reference_without_a_function_name_is_refused(ref):
    with pytest.raises(AgentLoadError) as e:
        load_agent(ref)
    assert str(e.value) == ("env.agent: expected 'package.module:function' or 'path/to/file.py:function', "
                            f"got {ref!r}")


@pytest.mark.parametrize("name", ["plain", "NOT_CALLABLE", "missing"])
def test_only_an_async_function_is_an_agent(agents_file, name):
    with pytest.raises(AgentLoadError) as e:
        load_agent(f"{agents_file}:{name}")
    assert str(e.value) == (f"env.agent '{agents_file}:{name}': '{agents_file}' has no async function '{name}' "
                            "(an agent is `async def agent(client, row) -> reward or record`)")


def test_an_import_failure_names_the_agent_not_a_reward(tmp_path):
    with pytest.raises(AgentLoadError) as e:
        load_agent(f"{tmp_path}/absent.py:agent")
    assert str(e.value).startswith(f"agent '{tmp_path}/absent.py:agent': file ") and "does not exist" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(AgentLoadError, match="^agent 'no_such_pkg_xyz:agent': importing module 'no_such_pkg_xyz'"):
        load_agent("no_such_pkg_xyz:agent")


def test_the_function_name_is_after_the_last_colon(tmp_path):
    folder = tmp_path / "run:1"  # a colon in the path: only the last one separates the function's name
    folder.mkdir()
    (folder / "a.py").write_text(AGENTS)
    fn = load_agent(f"{folder}/a.py:agent", {"bonus": 1.0})
    assert asyncio.run(fn("c", "r"))["bonus"] == 1.0


def test_only_the_loaders_word_reward_becomes_agent(tmp_path):
    ref = f"{tmp_path}/reward_agents/absent.py:agent"  # "reward" in the path stays as it is
    with pytest.raises(AgentLoadError) as e:
        load_agent(ref)
    assert str(e.value) == f"agent {ref!r}: file '{tmp_path}/reward_agents/absent.py' does not exist"
