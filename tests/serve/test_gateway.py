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
        # the tool calls the gateway parsed out of each turn are the ones the environment ran (the gateway
        # does not run tools: only what is wrong with a call itself can be an error there)
        assert [[(c["name"], c["arguments"], c["invalid"]) for c in x["tool_calls"]] for x in t["turns"]] == \
            [[(c["name"], c["arguments"], c["invalid"]) for c in x.tool_calls] for x in n.turns]
    assert {len(n.turns) for n in native} == {1, 2}, "calls and direct answers both occur"
    from rollout.trajectory import Trajectory, summarize

    counts = summarize([Trajectory.from_dict(a["trajectory"]) for a in agent])
    assert counts["agent/tool_calls"] == summarize(native)["agent/tool_calls"] > 0
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


# ---- time: an agent costs at most its timeouts; counts of what it did

def _run_bounded(gw, agent, rows, seeds=None, limit_s=60.0):
    """gw.run in a daemon thread: (samples, seconds), or a failed test when it does not return in `limit_s`."""
    import threading
    import time

    out = {}

    def go():
        t0 = time.monotonic()
        out["samples"] = gw.run(agent, rows, seeds)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"gateway.run did not return within {limit_s} s"
    return out["samples"], out["s"]


def test_a_hung_agent_costs_its_timeout_and_the_batch_goes_on(policy, rows):
    """step_timeout_s = T = 1 s. An agent that awaits forever before its first request, or after it, is
    cancelled 2 T after the start / its last answer (T for its next request, T more to return): stop
    `agent_timeout`, failed, counted; the other episodes of the batch are untouched and `run` returns."""
    import asyncio

    from rollout.trajectory import Trajectory, summarize

    async def never_asks(client, row):
        await asyncio.Event().wait()

    async def hangs_after_one(client, row):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        await asyncio.Event().wait()

    async def deaf(client, row):  # ignores its cancellation: abandoned, the batch goes on all the same
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def quick(client, row):
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return {"reward": 1.0, "text": r.choices[0].message.content}

    agents = [never_asks, hangs_after_one, deaf, quick]

    async def mixed(client, row):
        return await agents[[x["prompt"] for x in rows[:4]].index(row["prompt"])](client, row)

    gw = _gateway(policy, temperature=0.0, step_timeout_s=1.0)
    try:
        samples, took = _run_bounded(gw, mixed, rows[:4])
    finally:
        gw.close()
    trajs = [s["trajectory"] for s in samples]
    for t in trajs[:3]:
        assert t["stop"] == "agent_timeout" and t["failed"] and t["env_reward"] == 0.0, t["stop"]
    assert trajs[0]["turns"] == [] and len(trajs[1]["turns"]) == 1 and len(trajs[2]["turns"]) == 1
    assert trajs[3]["stop"] == "done" and not trajs[3]["failed"] and trajs[3]["env_reward"] == 1.0
    counts = summarize([Trajectory.from_dict(t) for t in trajs])
    assert counts["agent/stop/agent_timeout"] == 3 and counts["agent/failed_count"] == 3
    # 2 T after the last answer, plus the decoding of one turn and the abandoned agent's second
    assert took < 2 * 1.0 + 10.0, took


def test_a_slow_agent_ends_by_the_limit_and_is_not_counted_as_failed(policy, rows):
    """An agent whose next request comes 1.5 T after its answer: the episode ended at T with the limit's stop
    (`env_timeout`), the late request gets a 400 `episode_over`, and the episode is not failed whether the
    agent lets that error raise or returns a reward."""
    import asyncio

    async def slow(client, row, careful):
        messages = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=messages)
        await asyncio.sleep(1.5)
        messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "and now?"}]
        try:
            await client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as e:
            if careful:
                return {"reward": 0.5, "code": e.body["code"]}
            raise
        return {"reward": 1.0, "code": None}

    async def mixed(client, row):
        return await slow(client, row, careful=row["prompt"] == rows[0]["prompt"])

    gw = _gateway(policy, temperature=0.0, step_timeout_s=1.0)
    try:
        samples, _ = _run_bounded(gw, mixed, rows[:2])
    finally:
        gw.close()
    careful, careless = (s["trajectory"] for s in samples)
    for t in (careful, careless):
        assert t["stop"] == "env_timeout" and not t["failed"] and len(t["turns"]) == 1, (t["stop"], t["error"])
    assert careful["agent"] == {"reward": 0.5, "code": "episode_over"} and careful["env_reward"] == 0.5
    assert careless["env_reward"] == 0.0


def test_a_request_after_the_wait_ran_out_gets_episode_over_not_a_hang(policy, rows):
    """The agent's second request comes just after its wait ran out (T = 1 s), while the engine thread is held
    inside another episode's forward, so that its sequence cannot have finished yet: a clean 400
    `episode_over` at once, not a request queued where nobody reads it."""
    import asyncio
    import threading
    import time

    model, _ = policy
    free = threading.Event()
    free.set()

    def hold(*_):  # a forward pre-hook: returns None, or its value would replace the forward's inputs
        free.wait(30)

    hook = model.register_forward_pre_hook(hold)
    seen = {}

    async def late(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=messages)
        free.clear()  # the next forward (the busy episode's) holds the engine thread
        await asyncio.sleep(1.0 + 0.2)
        messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "and now?"}]
        asyncio.get_running_loop().call_later(0.5, free.set)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(client.chat.completions.create(model="policy", messages=messages), 20)
            seen["late"] = "answered"
        except openai.BadRequestError as e:
            seen["late"] = e.body["code"]
        except asyncio.TimeoutError:
            seen["late"] = "hung"
        seen["late_s"] = time.monotonic() - t0
        seen["done"] = True
        free.set()
        return 0.0

    async def busy(client, row):  # keeps the engine stepping: a fresh segment per request
        while not seen.get("done"):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return 0.0

    async def mixed(client, row):
        return await (late if row["prompt"] == rows[0]["prompt"] else busy)(client, row)

    gw = _gateway(policy, temperature=0.0, step_timeout_s=1.0)
    try:
        _run_bounded(gw, mixed, rows[:2], limit_s=120)
    finally:
        free.set()
        gw.close()
        hook.remove()
    assert seen["late"] == "episode_over" and seen["late_s"] < 5.0, seen


def test_any_model_name_is_the_policy_and_an_agent_without_requests_fails(policy, rows):
    """docs/serving.md: the gateway answers every request with the policy whatever `model` it names; an agent
    that returns without a request has nothing to train on: failed, `agent_error`, reward 0, its reward ignored."""
    async def other_name(client, row):
        r = await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": row["prompt"]}])
        return {"reward": 1.0, "model": r.model}

    async def no_request(client, row):
        return 1.0

    async def mixed(client, row):
        return await (other_name if row["prompt"] == rows[0]["prompt"] else no_request)(client, row)

    gw = _gateway(policy, temperature=0.0)
    try:
        named, silent = (s["trajectory"] for s in gw.run(mixed, rows[:2]))
    finally:
        gw.close()
    assert named["stop"] == "done" and not named["failed"] and len(named["turns"]) == 1
    assert named["agent"] == {"reward": 1.0, "model": "policy"} and named["env_reward"] == 1.0
    assert silent["failed"] and silent["stop"] == "agent_error" and silent["env_reward"] == 0.0
    assert silent["error"] == "the agent made no request" and silent["turns"] == []


def test_episodes_waiting_on_their_agents_hold_no_thread(policy, rows):
    """Agents that think between requests: while every episode waits for its agent's next request, no thread
    runs an environment step (the gateway answers each turn with a future), and the episodes still complete
    with the tokens they decode."""
    import asyncio
    import threading

    agent = _agent_module().calculator_agent
    seen = []

    async def slow_agent(client, row):
        orig = client.chat.completions.create

        async def create(*a, **kw):
            await asyncio.sleep(0.3)  # every episode waits here, its turn answered, its sequence paused
            seen.append(sorted(t.name for t in threading.enumerate()))
            return await orig(*a, **kw)

        client.chat.completions.create = create
        return await agent(client, row)

    gw = _gateway(policy)
    try:
        out = gw.run(slow_agent, rows, [1, 2, 3, 4, 5, 6])
    finally:
        gw.close()
    assert len(out) == len(rows) and all(s["trajectory"]["turns"] for s in out)
    later = [names for names in seen[len(rows):]]  # requests after a first answered turn: episodes waiting
    assert later and all(not any(n.startswith("ebpo-env-step") for n in names) for names in later)
    # the threads there are the driver's, the render pool's and the event loop's executor, none per episode
