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


# ---- the episode rules on the stub model of tests/support (milliseconds a forward) -------------------------------
# These check the documented rules (module docstring of ebpo/serve/gateway.py, docs/serving.md) with a model whose
# forwards cost nothing: the rendering is the tokenizer's below, the expected ids come from ebpo.serve.render.

class _ChatStub:
    """The stub tokenizer with a letters-only chat template: 't' per tool, each message as the initial of its role
    and its content, 'a' for the generation prompt (letters a..l are ids 0..11; anything else id 0)."""

    eos_token_id = 2

    def __init__(self):
        from tests.support.stub_engine_model import StubTokenizer

        self.inner = StubTokenizer(tool=7)

    def __call__(self, text, add_special_tokens=True):
        return self.inner(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        assert tokenize is False
        head = "t" * len(tools) if tools else ""
        return head + "".join(m["role"][0] + m["content"] for m in messages) + ("a" if add_generation_prompt else "")


FAST_MT = dict(max_turns=3, max_turn_tokens=8, max_total_tokens=96, step_timeout_s=20.0,
               observation_template="d{observation}e")
CALC = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


@pytest.fixture(scope="module")
def stub():
    from tests.support.stub_engine_model import StubModel

    return StubModel(K=4, seed=1, eos_rate=0.3), _ChatStub()


def _fast(stub, temperature=0.0, name="policy", **mt):
    from ebpo.serve.gateway import AgentGateway
    from rollout import DecodeConfig
    from rollout.multiturn import MultiTurnConfig

    model, tok = stub
    return AgentGateway(model, tok, DecodeConfig.preset("quality", temperature=temperature, max_new_tokens=8),
                        MultiTurnConfig(**{**FAST_MT, **mt}), max_batch=4, name=name)


def _run(gw, agent, n=1, seeds=None, limit_s=60.0):
    rows = [{"prompt": "gh" * (i + 1), "i": i} for i in range(n)]
    return _run_bounded(gw, agent, rows, seeds, limit_s)[0]


def _render_prompt(messages, tools=None):
    from ebpo.serve.render import prompt_ids

    return prompt_ids(_ChatStub(), messages, tools, 4, 2, FAST_MT["observation_template"])


def _render_ext(messages):
    from ebpo.serve.render import extension_ids

    return extension_ids(_ChatStub(), messages, FAST_MT["observation_template"])


def test_an_extending_request_continues_the_sequence_token_for_token(stub):
    """Two requests, the second the first plus the returned reply plus a tool result: one segment whose ids are
    the rendered prompt, the first answer's ids, the rendered tool message, the second answer's ids."""
    seen = {}

    async def agent(client, row):
        msgs = [{"role": "user", "content": row["prompt"]}]
        r1 = await client.chat.completions.create(model="gpt-4o", messages=msgs, tools=[CALC], temperature=1.7,
                                                  max_tokens=1)
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "fk"}]
        r2 = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALC])
        seen["r"] = (r1, r2)
        return {"reward": 0.75, "note": "x"}

    gw = _fast(stub, name="the-policy")
    try:
        s = _run(gw, agent)[0]
    finally:
        gw.close()
    r1, r2 = seen["r"]
    t = s["trajectory"]
    a1, a2 = r1.choices[0].model_extra["token_ids"], r2.choices[0].model_extra["token_ids"]
    prompt = _render_prompt([{"role": "user", "content": "gh"}], [CALC])
    obs = _render_ext([{"role": "tool", "content": "fk"}])
    assert t["prompt_ids"] == prompt and t["ids"] == prompt + a1 + obs + a2
    assert t["generated"] == [False] * len(prompt) + [True] * len(a1) + [False] * len(obs) + [True] * len(a2)
    # each turn ends on a block boundary, within the rollout's turn budget (8 tokens, rounded up to whole blocks)
    assert (len(prompt) + len(a1)) % 4 == 0 and (len(prompt) + len(a1) + len(obs) + len(a2)) % 4 == 0
    assert 0 < len(a1) <= 8 and 0 < len(a2) <= 11
    assert s["token_ids"] == t["ids"][len(prompt):]
    assert [x["text"] for x in t["turns"]] == [r1.choices[0].message.content or "", s["text"]]
    assert t["stop"] == "done" and not t["failed"] and t["segments"] == []
    assert t["env_reward"] == 0.75 and t["agent"] == {"reward": 0.75, "note": "x"}
    assert s["num_forwards"] == t["num_forwards"] > 0 and s["weights_version"] == 0
    # OpenAI fields: the served name, the usage of the sequence so far, one choice
    for k, (r, a) in enumerate(((r1, a1), (r2, a2)), start=1):
        assert r.model == "the-policy" and r.object == "chat.completion" and r.id.endswith(f"-{k}")
        assert r.usage.completion_tokens == len(a) and r.choices[0].index == 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + len(a)
        turn = t["turns"][k - 1]
        want = {"eos": "stop", "tool_call": "stop", "budget": "length"}[turn["finished_by"]]
        assert r.choices[0].finish_reason == want
        assert r.usage.model_extra["forwards"] == turn["forwards"] > 0
    # prompt_tokens: the context each answer was decoded after (OpenAI's prompt: everything before the answer)
    assert r1.usage.prompt_tokens == len(prompt) and r2.usage.prompt_tokens == len(prompt) + len(a1) + len(obs)
    assert r1.id != r2.id


def test_tool_choice_none_renders_no_tools(stub):
    async def agent(client, row):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}], tools=[CALC],
                                             tool_choice="none")
        return 1.0

    gw = _fast(stub)
    try:
        t = _run(gw, agent)[0]["trajectory"]
    finally:
        gw.close()
    assert t["prompt_ids"] == _render_prompt([{"role": "user", "content": "g"}])
    assert t["turns"][0]["tool_calls"] == []


def test_a_request_that_is_not_an_extension_starts_a_new_segment(stub):
    """Rewritten history (a changed earlier message, a changed reply, the same messages again, fewer): the current
    segment is ended and kept as `rewritten`, a new sequence starts from the rendered messages (a tool message in
    them in the rollout's observation template)."""
    seen = {}

    async def agent(client, row):
        msgs = [{"role": "user", "content": "gh"}]
        r = await client.chat.completions.create(model="p", messages=msgs)
        reply = r.choices[0].message.model_dump(exclude_none=True)
        await client.chat.completions.create(model="p", messages=msgs)  # the same messages again
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "gg"}, reply,
                                                                  {"role": "tool", "content": "h"}])
        seen["reply"] = reply
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "jj"}])
        changed = {**r.choices[0].message.model_dump(exclude_none=True), "content": "zz"}
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "jj"}, changed,
                                                                  {"role": "user", "content": "h"}])
        return 1.0

    gw = _fast(stub, max_turns=5)
    try:
        t = _run(gw, agent)[0]["trajectory"]
    finally:
        gw.close()
    assert [seg["stop"] for seg in t["segments"]] == ["rewritten"] * 4
    reply = {"role": "assistant", "content": seen["reply"].get("content") or ""}
    assert [seg["prompt_ids"] for seg in t["segments"]] == [
        _render_prompt([{"role": "user", "content": c}]) for c in ("gh", "gh")] + [
        _render_prompt([{"role": "user", "content": "gg"}, reply, {"role": "tool", "content": "h"}]),
        _render_prompt([{"role": "user", "content": "jj"}])]
    assert len(t["turns"]) == 1 and t["stop"] == "done" and t["env_reward"] == 1.0
    assert t["prompt_ids"][:len(_render_prompt([{"role": "user", "content": "jj"}]))] == \
        _render_prompt([{"role": "user", "content": "jj"}])


def test_the_turn_limit_answers_episode_over_and_is_no_failure(stub):
    codes = []

    async def talker(client, row):
        msgs = [{"role": "user", "content": "g"}]
        try:
            while True:
                r = await client.chat.completions.create(model="p", messages=msgs)
                msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]
        except openai.BadRequestError as e:
            codes.append((e.status_code, e.body["code"], e.body["param"], e.body["message"]))
            raise

    gw = _fast(stub, max_turns=2)
    try:
        t = _run(gw, talker)[0]["trajectory"]
    finally:
        gw.close()
    assert codes == [(400, "episode_over", "messages", "the episode is over (max_turns); no more turns")]
    assert t["stop"] == "max_turns" and not t["failed"] and len(t["turns"]) == 2 and t["env_reward"] == 0.0


@pytest.mark.parametrize("what", ["raises", "silent", "bool", "no_reward", "after_over"])
def test_how_an_agent_ends_decides_failure_and_reward(stub, what):
    async def agent(client, row):
        if what == "silent":
            return 1.0
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        if what == "raises":
            raise KeyError("harness bug")
        return True if what == "bool" else {"reward": "1", "k": 2}

    gw = _fast(stub)
    try:
        t = _run(gw, agent)[0]["trajectory"]
    finally:
        gw.close()
    if what == "raises":
        assert t["failed"] and t["stop"] == "agent_error" and t["error"] == "KeyError: 'harness bug'"
        assert t["agent"] == {"error": "KeyError: 'harness bug'"} and len(t["turns"]) == 1
    elif what == "silent":
        assert t["failed"] and t["stop"] == "agent_error" and t["error"] == "the agent made no request"
        assert t["turns"] == [] and t["ids"] == [] and t["agent"] == {"error": "the agent made no request"}
    else:
        assert not t["failed"] and t["stop"] == "done" and t["error"] is None
        assert t["agent"] == ({"reward": True} if what == "bool" else {"reward": "1", "k": 2})
    assert t["env_reward"] == 0.0  # failed, or a reward that is not a number (a bool is not one)


def test_requests_the_gateway_refuses(stub):
    out = {}

    async def agent(client, row):
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}], n=2)
        except openai.BadRequestError as e:
            out["n"] = (e.body["code"], e.body["param"], e.body["message"])
        base = str(client.base_url).replace(f"/episodes/{row['eid']}/", "/episodes/nope/")
        other = openai.AsyncOpenAI(base_url=base, api_key="x", http_client=client._client, max_retries=0)
        try:
            await other.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        except openai.NotFoundError as e:
            out["episode"] = (e.status_code, e.body["code"], e.body["message"])
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "assistant", "content": "g"}])
        except openai.BadRequestError as e:
            out["render"] = (e.body["param"], "nothing to answer" in e.body["message"])
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        return 1.0

    gw = _fast(stub)
    try:
        async def named(client, row):
            return await agent(client, {**row, "eid": str(client.base_url).split("/episodes/")[1].split("/")[0]})
        t = _run(gw, named)[0]["trajectory"]
    finally:
        gw.close()
    assert out == {"n": (None, "n", "an agent episode samples one completion per request (n = 1)"),
                   "episode": (404, "unknown_episode",
                               "the gateway serves episodes: /episodes/{episode}/v1 of a running episode"),
                   "render": ("messages", True)}
    assert not t["failed"] and len(t["turns"]) == 1 and t["segments"] == []


def test_seeds_seed_the_sampling_and_must_match_the_rows(stub):
    async def agent(client, row):
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
        return len(r.choices[0].model_extra["token_ids"])

    gw = _fast(stub, temperature=1.0)
    try:
        with pytest.raises(ValueError, match="one seed per row"):
            gw.run(agent, [{"prompt": "g"}], [1, 2])
        a = _run(gw, agent, n=3, seeds=[5, 6, 7])
        b = _run(gw, agent, n=3, seeds=[5, 6, 7])
        c = [_run(gw, agent, n=3, seeds=[50 + k, 60 + k, 70 + k]) for k in range(3)]
    finally:
        gw.close()
    ids = [[s["trajectory"]["ids"] for s in run] for run in (a, b, *c)]
    assert ids[0] == ids[1]
    assert any(other != ids[0] for other in ids[2:])
    assert gw.episodes == {}  # every episode left the table


@pytest.mark.parametrize("late", [False, True])
def test_the_agents_clock(stub, late):
    """T = 0.4 s. An agent that never asks is cancelled at 2 T: agent_timeout, failed. One whose next request comes
    after T: env_timeout (the limit's), not failed; its late request is refused with episode_over."""
    import asyncio

    codes = []

    async def never(client, row):
        await asyncio.sleep(30)

    async def slow(client, row):
        msgs = [{"role": "user", "content": "g"}]
        r = await client.chat.completions.create(model="p", messages=msgs)
        await asyncio.sleep(0.7)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]
        try:
            await client.chat.completions.create(model="p", messages=msgs)
        except openai.BadRequestError as e:
            codes.append((e.body["code"], e.body["param"], e.body["message"]))
        return 0.5

    gw = _fast(stub, step_timeout_s=0.4)
    try:
        samples, took = _run_bounded(gw, slow if late else never, [{"prompt": "g"}], limit_s=30)
    finally:
        gw.close()
    t = samples[0]["trajectory"]
    if late:
        assert t["stop"] == "env_timeout" and not t["failed"] and t["env_reward"] == 0.5 and len(t["turns"]) == 1
        assert codes == [("episode_over", "messages", "the episode is over (no request came within step_timeout_s "
                                                      "(0.4 s)); no more turns")]
    else:
        assert t["stop"] == "agent_timeout" and t["failed"] and t["turns"] == []
        assert t["error"] == "the agent function did not return within 2 x step_timeout_s (0.8 s) of its last answer"
        assert 0.8 <= took < 5.0, took


def test_a_hung_agent_after_its_answer_keeps_its_turn_but_fails(stub):
    import asyncio

    async def hangs(client, row):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        await asyncio.sleep(30)

    gw = _fast(stub, step_timeout_s=0.4)
    try:
        samples, took = _run_bounded(gw, hangs, [{"prompt": "g"}], limit_s=30)
    finally:
        gw.close()
    t = samples[0]["trajectory"]
    assert t["stop"] == "agent_timeout" and t["failed"] and len(t["turns"]) == 1 and t["env_reward"] == 0.0
    assert t["agent"] == {"error": t["error"]} and "2 x step_timeout_s (0.8 s)" in t["error"]
    assert 0.8 <= took < 5.0, took


# ---- the episode's own rules, without an engine --------------------------------------------------------------

def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_extends_is_the_history_then_the_returned_reply_then_new_messages():
    from ebpo.serve.gateway import _extends

    call = {"id": "x", "type": "function", "function": {"name": "calc", "arguments": "{\"expr\": \"1\"}"}}
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    history = _msgs(("system", "s"), ("user", "q")) + [reply]
    sent_reply = {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "other"}]}
    assert _extends(history, _msgs(("system", "s"), ("user", "q")) + [sent_reply] + _msgs(("tool", "2")))
    assert _extends(history, history + _msgs(("tool", "2"), ("user", "u")))
    assert not _extends(history, history)  # nothing new
    assert not _extends(history, history[:2])
    assert not _extends(history, _msgs(("system", "S"), ("user", "q")) + [reply] + _msgs(("tool", "2")))
    assert not _extends(history, _msgs(("user", "s"), ("user", "q")) + [reply] + _msgs(("tool", "2")))
    assert not _extends(history, _msgs(("system", "s"), ("user", "q"), ("assistant", "hi"), ("tool", "2")))
    assert not _extends(history, _msgs(("system", "s"), ("user", "q"), ("user", "x"), ("tool", "2")))
    # an earlier assistant turn must match in its calls too, not only in role and content
    h2 = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "content": "2"}, {"role": "assistant", "content": "ok", "tool_calls": []}]
    other_call = {**call, "function": {"name": "calc", "arguments": "{\"expr\": \"2\"}"}}
    same = [h2[0], {"role": "assistant", "content": "", "tool_calls": [call]}, h2[2], h2[3], *_msgs(("user", "u"))]
    assert _extends(h2, same)
    changed = [h2[0], {"role": "assistant", "content": "", "tool_calls": [other_call]}, h2[2], h2[3],
               *_msgs(("user", "u"))]
    assert not _extends(h2, changed)


class _Turn:
    start, end, finished_by = 4, 8, "eos"


class _FakeSeq:
    turns = [_Turn()]


class _FakeDriver:
    class engine:  # noqa: N801 - stands in for the engine's attribute
        class runner:  # noqa: N801
            @staticmethod
            def read(seq, lo, hi):
                return list(range(lo, hi))

    class tokenizer:  # noqa: N801
        @staticmethod
        def decode(ids):
            return "|".join(map(str, ids))


def _episode():
    import concurrent.futures

    from ebpo.serve.gateway import Episode

    ep = Episode("e", {"p": 1}, None, 5.0)
    reply = concurrent.futures.Future()
    ep.start_segment(reply, [CALC])
    ep.bind(_FakeSeq(), _FakeDriver())
    return ep, reply


def test_a_turn_answers_its_request_and_records_its_tool_calls():
    import concurrent.futures

    ep, reply = _episode()
    text = "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"1\"}}</tool_call>" \
           "<tool_call>{\"name\": \"calc\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"rm\"}</tool_call>"
    step = ep.step_async(text)
    assert reply.result(0) == (text, [4, 5, 6, 7], "eos")
    assert not step.done() and ep.waiting
    calls = ep.info["tool_calls"]
    assert [(c["name"], c["ok"], c["error"]) for c in calls] == [
        ("calc", True, None), ("calc", False, "missing argument 'expr'"), ("rm", False, "unknown tool 'rm'")]
    nxt = concurrent.futures.Future()
    assert ep.offer([1, 2], nxt, None) is True
    (obs, reward, done, info), secs = step.result(0)
    assert (obs, reward, done, secs) == ("1|2", 0.0, False, 0.0)
    assert info == {"tool_calls": calls, "observation_ids": [1, 2]}
    assert ep.reply is nxt and ep.tools is None and not ep.waiting and ep.pending is None
    assert ep.offer([3], concurrent.futures.Future(), None) is False  # no step waits now


def test_ending_a_segment_closes_its_waiting_step_or_its_next_one():
    import concurrent.futures

    from ebpo.serve.gateway import END, REWRITE, TIMEOUT

    ep, reply = _episode()
    step = ep.step_async("plain")
    assert ep.info == {"tool_calls": []}
    ep.end(REWRITE)
    ep.end(END)  # the first reason stays
    assert step.result(0) == ((None, 0.0, True, {"tool_calls": [], "ended_by": REWRITE}), 0.0)
    assert ep.ended_by == REWRITE and not ep.waiting and ep.pending is None
    assert ep.offer([1], concurrent.futures.Future(), None) is False

    ep, reply = _episode()
    ep.expire()  # no step waits yet: the next one ends the segment at once
    assert ep.expired and ep.expired_at > 0 and ep.ending == TIMEOUT
    step = ep.step_async("late")
    assert step.result(0)[0][2] is True and step.result(0)[0][3]["ended_by"] == TIMEOUT
    assert reply.result(0)[0] == "late" and not ep.waiting
    assert ep.over_because() == "no request came within step_timeout_s (5 s)"

    ep, _ = _episode()
    ep.step_async("x")
    ep.end(END)
    ep.start_segment(concurrent.futures.Future(), None)  # a new segment forgets how the last one ended
    assert (ep.waiting, ep.pending, ep.ending, ep.ended_by, ep.seq, ep.tools) == (False, None, None, None, None, None)


def test_why_an_episode_is_over():
    import concurrent.futures
    from types import SimpleNamespace

    ep, _ = _episode()
    assert ep.over_because() == "its sequence is ending"
    ep.segment = concurrent.futures.Future()
    assert ep.over_because() == "its sequence is ending"
    ep.segment.set_result(SimpleNamespace(stop="max_total_tokens"))
    assert ep.over_because() == "max_total_tokens"
    ep.segment = concurrent.futures.Future()
    ep.segment.set_result(SimpleNamespace(stop=""))
    assert ep.over_because() == "done"
    ep.segment = concurrent.futures.Future()
    ep.segment.set_exception(RuntimeError("x"))
    assert ep.over_because() == "its sequence is ending"


def test_closing_a_batch_loop_cancels_what_an_abandoned_agent_left():
    import asyncio

    from ebpo.serve.gateway import _close_loop

    loop = asyncio.new_event_loop()
    seen = []

    async def stubborn():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = loop.create_task(stubborn())
    loop.run_until_complete(asyncio.sleep(0))
    _close_loop(loop)
    assert seen == ["cancelled"] and task.cancelled() and loop.is_closed()
    empty = asyncio.new_event_loop()
    _close_loop(empty)
    assert empty.is_closed()


def test_concurrent_requests_of_one_episode_keep_its_clock_stopped_until_both_are_answered(stub):
    """Two requests in flight at once, then the agent hangs: the clock stopped while either was answered and runs
    again after both (so the hung agent still costs its 2 T, not forever)."""
    import asyncio

    async def twice_then_hang(client, row):
        msgs = [{"role": "user", "content": "g"}]
        await asyncio.gather(client.chat.completions.create(model="p", messages=msgs),
                             client.chat.completions.create(model="p", messages=msgs))
        await asyncio.sleep(30)

    gw = _fast(stub, step_timeout_s=0.4)
    try:
        samples, took = _run_bounded(gw, twice_then_hang, [{"prompt": "g"}], limit_s=20)
    finally:
        gw.close()
    t = samples[0]["trajectory"]
    assert t["stop"] == "agent_timeout" and t["failed"] and took < 5.0, (t["stop"], took)


class _CallingStub(_ChatStub):
    """Decodes ids 3 to 7 each as a whole, well-formed tool call of `calc`: a turn that samples one calls the tool
    (the stub model samples them often, so that most turns call)."""

    CALL = "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"1\"}}</tool_call>"

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.CALL if 3 <= t <= 7 else self.inner.decode([t], skip_special_tokens) for t in ids)


def test_tool_calls_in_the_models_turns_are_returned_and_counted_against_the_turns_tools(stub):
    from rollout.trajectory import Trajectory, summarize

    seen = []

    async def agent(client, row):
        msgs = [{"role": "user", "content": "gh"}]
        for k in range(3):
            r = await client.chat.completions.create(model="p", messages=msgs, tools=[CALC] if k != 1 else None)
            seen.append(r)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "f"}]
        return 1.0

    model, _ = stub
    gw = _fast((model, _CallingStub()), max_turns=3)
    try:
        t = _run(gw, agent)[0]["trajectory"]
    finally:
        gw.close()
    assert len(t["turns"]) == 3 and t["segments"] == []
    called = [k for k, turn in enumerate(t["turns"]) if _CallingStub.CALL in turn["text"]]
    assert 2 in called, "the third turn (an extension with tools) made no call: pick another stub seed"
    for k, turn in enumerate(t["turns"]):
        n = turn["text"].count("<tool_call>")
        ok = k != 1  # the second request sent no tools: its turn's calls name an unknown tool
        assert [(c["name"], c["ok"]) for c in turn["tool_calls"]] == [("calc", ok)] * n
        msg = seen[k].choices[0]
        if n:
            assert msg.finish_reason == "tool_calls"
            assert [c.id for c in msg.message.tool_calls] == [f"call_1-0_{k}_{j}" for j in range(n)]
            assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.message.tool_calls] == \
                [("calc", {"expr": "1"})] * n
        else:
            assert msg.message.tool_calls is None and msg.finish_reason in ("stop", "length")
    counts = summarize([Trajectory.from_dict(t)])
    n_calls = sum(turn["text"].count("<tool_call>") for turn in t["turns"])
    assert counts["agent/tool_calls"] == n_calls > 0


def test_a_request_that_comes_when_no_turn_waits_is_refused_not_queued(stub):
    """An extension that finds the segment ending (no step waits for it) gets episode_over at once."""
    import asyncio
    import concurrent.futures
    from types import SimpleNamespace

    from ebpo.serve.gateway import Episode
    from ebpo.serve.schema import RequestError, parse_request

    gw = _fast(stub)
    try:
        ep = Episode("e", {}, None, 20.0)
        ep.history = [{"role": "user", "content": "g"}, {"role": "assistant", "content": "x", "tool_calls": []}]
        ep.segment = concurrent.futures.Future()  # its sequence still running, its step not waiting
        gw.episodes["e"] = ep
        req = parse_request({"model": "p", "messages": ep.history + [{"role": "tool", "content": "y"}]},
                            gw.config, 1 << 30)
        with pytest.raises(RequestError) as e:
            asyncio.run(asyncio.wait_for(gw._complete(SimpleNamespace(path_params={"episode": "e"}), req), 10))
    finally:
        gw.close()
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "episode_over")
    assert e.value.message == "the episode is over (its sequence is ending); no more turns"
    assert ep.in_flight == 0
