"""The agent gateway: agent functions with the real `openai` client, token-exact episodes.

* the calculator task through an agent function decodes, seed for seed, the trajectories of the native
  environment path (same ids, same turn mask, same rewards);
* the ids the learner sees (the sample's trajectory, through `build_learner_batch`) are the ids the engine
  sampled for each request, with the observations rendered independently in between;
* equal seeds give equal trajectories; a rewritten history starts a new, recorded segment; the episode's
  limits and the agent's own failures end episodes without failing the batch.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
MT = dict(max_turns=3, max_turn_tokens=96, max_total_tokens=320, step_timeout_s=20.0)


def _agent_module():
    spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / "examples/agents/calculator_agent.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def policy():
    from ebpo.model.loading import load_model, load_model_tokenizer

    return load_model("tiny-agent").eval(), load_model_tokenizer("tiny-agent")


@pytest.fixture(scope="module")
def rows():
    lines = (ROOT / "examples/data/agent_train.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[:6]]


def _gateway(policy, temperature=1.0, **mt):
    from ebpo.serve.gateway import AgentGateway
    from rollout import DecodeConfig
    from rollout.multiturn import MultiTurnConfig

    model, tok = policy
    return AgentGateway(model, tok, DecodeConfig.preset("quality", temperature=temperature),
                        MultiTurnConfig(**{**MT, **mt}))


def _chat_ids(tok, messages, tools):
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_agent_path_decodes_the_native_environment_trajectories(policy, rows):
    from rewards.envs.calculator import calculator_env
    from rollout import DecodeConfig
    from rollout.multiturn import MultiTurnConfig, run_episodes

    model, tok = policy
    specs = calculator_env().specs
    prompts = [_chat_ids(tok, [{"role": "user", "content": r["prompt"]}], specs) for r in rows]
    seeds = [100 + i for i in range(len(rows))]
    with torch.no_grad():
        native = run_episodes(model, prompts, rows, lambda: calculator_env(max_turns=3),
                              DecodeConfig.preset("quality", temperature=1.0), MultiTurnConfig(**MT), tokenizer=tok,
                              seeds=seeds)
    gw = _gateway(policy)
    try:
        agent = gw.run(_agent_module().calculator_agent, rows, seeds)
    finally:
        gw.close()
    for n, a in zip(native, agent):
        t = a["trajectory"]
        assert (t["prompt_ids"], t["ids"], t["generated"], t["segment"]) == (n.prompt_ids, n.ids, n.generated, n.segment)
        assert (t["stop"], t["env_reward"], len(t["turns"])) == (n.stop, n.env_reward, len(n.turns))
        assert [x["text"] for x in t["turns"]] == [x.text for x in n.turns]
    assert {len(n.turns) for n in native} == {1, 2}, "calls and direct answers both occur"
    assert 0 < sum(n.env_reward for n in native) < len(rows)


def test_the_learner_sees_exactly_the_sampled_ids(policy, rows):
    """A recording agent keeps the token ids each request was answered with (at sampling time) and the tool
    results it sent; the learner's row is the rendered prompt, then each answer's ids, then each tool turn
    rendered on its own, and its scored positions are exactly the answers'."""
    from ebpo.core.turns import OBSERVATION_TEMPLATE
    from ebpo.rl.records import build_learner_batch

    model, tok = policy
    base = _agent_module()
    seen: dict = {}

    async def recording(client, row):
        log = seen.setdefault(row["prompt"], {"answers": [], "tools": []})
        inner_create = client.chat.completions.create

        async def create(**kw):
            r = await inner_create(**kw)
            log["answers"].append(r.choices[0].model_extra["token_ids"])
            log["tools"].append([m["content"] for m in kw["messages"] if m["role"] == "tool"])
            return r

        client.chat.completions.create = create
        return await base.calculator_agent(client, row)

    gw = _gateway(policy)
    try:
        samples = gw.run(recording, rows[:4], [7, 8, 9, 10])
    finally:
        gw.close()
    specs = base.calculator_env().specs
    for row, s in zip(rows[:4], samples):
        t, log = s["trajectory"], seen[row["prompt"]]
        expected = _chat_ids(tok, [{"role": "user", "content": row["prompt"]}], specs)
        scored = [False] * len(expected)
        for k, answer in enumerate(log["answers"]):
            if k:  # the tool results sent with request k, after answer k-1
                new = log["tools"][k][len(log["tools"][k - 1]):]
                obs = tok(OBSERVATION_TEMPLATE.format(observation="\n".join(new)), add_special_tokens=False)["input_ids"]
                expected, scored = expected + obs, scored + [False] * len(obs)
            expected, scored = expected + answer, scored + [True] * len(answer)
        assert t["ids"] == expected and t["generated"] == scored
        assert s["token_ids"] == expected[len(t["prompt_ids"]):]
        batch = build_learner_batch([t["prompt_ids"]], [s["token_ids"]], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                                    pad_id=tok.eos_token_id, turns=[(t["generated"], t["segment"])], block_size=8)
        assert batch.input_ids[0, : len(expected)].tolist() == expected
        assert batch.response_mask[0, : len(expected)].tolist() == scored


def test_equal_seeds_give_equal_trajectories(policy, rows):
    agent = _agent_module().calculator_agent
    gw = _gateway(policy)
    try:
        first = gw.run(agent, rows, [1, 2, 3, 4, 5, 6])
        again = gw.run(agent, rows, [1, 2, 3, 4, 5, 6])
        other = gw.run(agent, rows, [11, 12, 13, 14, 15, 16])
    finally:
        gw.close()
    key = [(s["trajectory"]["ids"], s["trajectory"]["turns"][-1]["text"]) for s in first]
    assert key == [(s["trajectory"]["ids"], s["trajectory"]["turns"][-1]["text"]) for s in again]
    assert key != [(s["trajectory"]["ids"], s["trajectory"]["turns"][-1]["text"]) for s in other]


def test_a_rewritten_history_starts_a_new_recorded_segment(policy, rows):
    model, tok = policy

    async def rewriter(client, row):
        first = [{"role": "user", "content": row["prompt"]}]
        await client.chat.completions.create(model="policy", messages=first)
        second = [{"role": "user", "content": "Compute 12*12."}]  # not an extension: the first turn is dropped
        r = await client.chat.completions.create(model="policy", messages=second)
        return {"reward": 0.5, "answer": r.choices[0].message.content}

    gw = _gateway(policy, temperature=0.0)
    try:
        s = gw.run(rewriter, rows[:1])[0]
    finally:
        gw.close()
    t = s["trajectory"]
    assert len(t["segments"]) == 1 and t["segments"][0]["stop"] == "rewritten"
    assert t["segments"][0]["prompt_ids"] == _chat_ids(tok, [{"role": "user", "content": rows[0]["prompt"]}], None)
    assert t["prompt_ids"] == _chat_ids(tok, [{"role": "user", "content": "Compute 12*12."}], None)
    assert t["env_reward"] == 0.5 and t["agent"]["reward"] == 0.5 and t["stop"] == "done" and not t["failed"]


def test_limits_and_agent_failures_end_their_episode_only(policy, rows):
    async def talker(client, row):  # never stops asking: the episode's turn limit answers with episode_over
        messages = [{"role": "user", "content": row["prompt"]}]
        try:
            while True:
                r = await client.chat.completions.create(model="policy", messages=messages)
                messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
        except openai.BadRequestError as e:
            return {"reward": 1.0, "code": e.body["code"]}

    async def broken(client, row):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        raise RuntimeError("harness bug")

    async def careless(client, row):  # lets the episode_over refusal propagate: the limit, not the agent, ended it
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "again"}]

    async def mixed(client, row):
        which = [x["prompt"] for x in rows[:3]].index(row["prompt"])
        return await (talker, broken, careless)[which](client, row)

    gw = _gateway(policy, temperature=0.0, max_turns=2)
    try:
        a, b, c = gw.run(mixed, rows[:3])
    finally:
        gw.close()
    assert a["trajectory"]["agent"]["code"] == "episode_over" and a["trajectory"]["stop"] == "max_turns"
    assert len(a["trajectory"]["turns"]) == 2 and not a["trajectory"]["failed"]
    assert b["trajectory"]["failed"] and b["trajectory"]["stop"] == "agent_error"
    assert "harness bug" in b["trajectory"]["error"] and b["trajectory"]["env_reward"] == 0.0
    assert c["trajectory"]["stop"] == "max_turns" and not c["trajectory"]["failed"] and len(c["trajectory"]["turns"]) == 2
