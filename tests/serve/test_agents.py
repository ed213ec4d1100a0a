"""ebpo.serve.agents: loading an agent function from a recipe's `env.agent` reference, and `AgentRolloutWorker`
built in this process (no Ray) on a random tiny model: one episode per row through the gateway, in row order, with the
bound agent kwargs, the episode limits and the per-call decode settings; seeds that reproduce; a row whose agent
fails before its first request keeps the prompt it was given; without rows, plain single-turn decoding.

The agent RL runs themselves (AgentRolloutWorker through real trainers, over Ray) are in
tests/rl/test_agent_function_rl.py."""
import asyncio

import pytest

from ebpo.serve.agents import AgentLoadError, AgentRolloutWorker, load_agent

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


# ---- AgentRolloutWorker, in-process

WORKER_AGENTS = '''
async def echo(client, row, tag="unbound"):
    if row.get("fail"):
        raise RuntimeError("gave up before asking")
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return {"reward": row["score"], "tag": tag, "row": row, "text": r.choices[0].message.content}
'''
# episode limits far from MultiTurnConfig's defaults (4 turns, 96, 512, 30 s), so that losing them shows
MT = {"max_turns": 1, "max_turn_tokens": 8, "max_total_tokens": 64, "step_timeout_s": 20.0}
DECODE = {"preset": "quality", "temperature": 1.0, "max_new_tokens": 8}
ROWS = [{"prompt": "Compute 2+2.", "score": 0.25}, {"prompt": "Name a prime.", "score": 0.75}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    pytest.importorskip("openai")
    path = tmp_path_factory.mktemp("agents") / "worker_agents.py"
    path.write_text(WORKER_AGENTS)
    return AgentRolloutWorker("preset:tiny", DECODE, agent=f"{path}:echo", agent_kwargs={"tag": "bound"},
                              multiturn=MT)


@pytest.fixture()
def gateways(monkeypatch):
    """Every AgentGateway the worker builds, as [(args, kwargs, closed)], the real gateway behind it."""
    import ebpo.serve.gateway as gateway

    built = []

    class Recorded(gateway.AgentGateway):
        def __init__(self, *args, **kwargs):
            built.append({"args": args, "kwargs": kwargs, "closed": 0})
            super().__init__(*args, **kwargs)

        def close(self):
            built[-1]["closed"] += 1
            super().close()

    monkeypatch.setattr(gateway, "AgentGateway", Recorded)
    return built


def _chat_prompt(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def test_one_episode_per_row_in_order_with_the_bound_kwargs(worker, gateways):
    from rollout import DecodeConfig
    from rollout.multiturn import MultiTurnConfig

    worker.load_weights(worker.model.state_dict(), 5)
    samples = worker.generate([[901], [902, 903]], [11, 12], rows=[dict(r) for r in ROWS])
    assert len(samples) == 2
    for row, s in zip(ROWS, samples):
        t = s["trajectory"]
        assert t["agent"]["row"] == row and t["agent"]["tag"] == "bound"
        assert t["env_reward"] == row["score"] and not t["failed"]
        # the episode's prompt is the agent's first request rendered by the chat template, not the given ids
        assert t["prompt_ids"] == _chat_prompt(worker.tokenizer, row["prompt"])
        assert s["text"] == t["agent"]["text"] and s["token_ids"] == t["ids"][len(t["prompt_ids"]):]
        # one turn of at most max_turn_tokens, rounded up to whole blocks (the first one shares the prompt's last block)
        assert 0 < len(s["token_ids"]) < MT["max_turn_tokens"] + worker.model.config.block_size
        assert s["weights_version"] == 5
    # one gateway per call, with the worker's config, episode limits and batch bound, closed afterwards
    (g,) = gateways
    config = DecodeConfig.preset("quality", temperature=1.0, max_new_tokens=8)
    assert g["args"][2] == config and g["args"][3] == MultiTurnConfig(**MT)
    assert g["kwargs"] == {"max_batch": config.max_batch} and g["closed"] == 1
    assert g["args"][0] is worker.model and g["args"][1] is worker.tokenizer


def test_equal_seeds_give_equal_episodes_and_other_seeds_others(worker):
    rows = [ROWS[0]] * 3
    same, again, other = (s["trajectory"]["ids"] for s in worker.generate([[1]] * 3, [3, 3, 5], rows=rows))
    assert same == again
    assert other != same  # 8 tokens sampled from a random model's 128-token vocabulary: equal by chance ~never
    with pytest.raises(ValueError, match=r"^AgentRolloutWorker.generate: one seed per row \(2\), got 1$"):
        worker.generate([[1], [1]], [3], rows=ROWS)


def test_a_call_decode_replaces_the_worker_config_quality_by_default(worker, gateways):
    from rollout import DecodeConfig

    decode, speed = {"temperature": 0.0, "max_new_tokens": 4}, {"preset": "speed", "tau_mask": 0.5}
    greedy = worker.generate([[1]] * 2, [1, 2], decode=decode, rows=[ROWS[0]] * 2)
    assert greedy[0]["trajectory"]["ids"] == greedy[1]["trajectory"]["ids"]  # greedy: the seeds do not matter
    worker.generate([[1]], [1], decode=speed, rows=ROWS[:1])
    assert (decode, speed) == ({"temperature": 0.0, "max_new_tokens": 4}, {"preset": "speed", "tau_mask": 0.5})
    expected = [DecodeConfig.preset("quality", temperature=0.0, max_new_tokens=4),
                DecodeConfig.preset("speed", tau_mask=0.5)]
    assert [g["args"][2] for g in gateways] == expected  # the caller's dicts above were left alone
    assert [g["kwargs"]["max_batch"] for g in gateways] == [c.max_batch for c in expected]


def test_an_agent_that_fails_before_asking_keeps_its_rows_prompt(worker, gateways):
    worker.load_weights(worker.model.state_dict(), 2)
    rows = [{"prompt": "ok", "score": 1.0}, {"prompt": "x", "score": 1.0, "fail": True}]
    ok, failed = worker.generate([[31, 32, 33], [41, 42]], [1, 2], rows=rows)
    t = failed["trajectory"]
    assert t["failed"] and t["stop"] == "agent_error" and "gave up before asking" in t["error"]
    assert (t["prompt_ids"], t["ids"], t["generated"], t["segment"]) == ([41, 42], [41, 42], [False, False], [0, 0])
    assert failed["token_ids"] == [] and failed["weights_version"] == 2 and t["env_reward"] == 0.0
    assert ok["trajectory"]["prompt_ids"] == _chat_prompt(worker.tokenizer, "ok") and ok["weights_version"] == 2
    assert [g["closed"] for g in gateways] == [1]


def test_the_gateway_is_closed_when_the_run_raises(worker, gateways, monkeypatch):
    import ebpo.serve.gateway as gateway

    def boom(self, agent, rows, seeds=None):
        raise RuntimeError("engine thread died")

    monkeypatch.setattr(gateway.AgentGateway, "run", boom)
    with pytest.raises(RuntimeError, match="engine thread died"):
        worker.generate([[1]], [1], rows=ROWS[:1])
    assert [g["closed"] for g in gateways] == [1]


def test_without_rows_it_decodes_single_turn_as_a_rollout_worker(worker):
    from rollout.worker import RolloutWorker

    plain = RolloutWorker("preset:tiny", DECODE)
    plain.load_weights(worker.model.state_dict(), worker.version)
    prompts, seeds = [[4, 82, 83, 7, 5], [4, 28, 21, 28, 7, 5]], [21, 22]
    short = {"temperature": 0.0, "max_new_tokens": 4}
    for decode in (None, short):
        got, want = worker.generate(prompts, seeds, decode), plain.generate(prompts, seeds, decode)
        assert [s["token_ids"] for s in got] == [s["token_ids"] for s in want]
        assert all("trajectory" not in s for s in got)
        assert max(len(s["token_ids"]) for s in got) == (decode or DECODE)["max_new_tokens"]


def test_a_bad_agent_reference_fails_at_construction(agents_file):
    with pytest.raises(AgentLoadError, match="has no async function 'plain'"):
        AgentRolloutWorker("preset:tiny", {}, agent=f"{agents_file}:plain")
    with pytest.raises(AgentLoadError, match="do not fit its signature"):
        AgentRolloutWorker("preset:tiny", {}, agent=f"{agents_file}:agent", agent_kwargs={"turns": 2})


def test_the_other_arguments_are_the_rollout_workers(agents_file):
    from ebpo.model.loading import load_model
    from rollout.weight_sync import state_dict_digest

    policy = load_model("preset:tiny@7").state_dict()  # other weights than preset:tiny's own
    w = AgentRolloutWorker("preset:tiny", {}, agent=f"{agents_file}:agent", weights=policy, weights_version=9)
    assert w.version == 9 and w.weights_digest() == state_dict_digest(policy)
    assert w.weights_digest() != state_dict_digest(load_model("preset:tiny").state_dict())
