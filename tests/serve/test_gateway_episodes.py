"""The agent gateway's episodes on the stub model: the sample each returns, how failures are recorded, the
engine and render pool the gateway sets up, and the agent's clock (module docstring of ebpo/serve/gateway.py,
docs/serving.md "The agent gateway", docs/how-to/agent-functions.md).

The references are independent of the gateway: `rollout.worker._multi_turn_sample` (the sample a
`RolloutWorker` returns for a multi-turn row, which the gateway's samples must equal), the OpenAI API's fields,
and the documented rules.
"""
import asyncio
import threading
import time

import pytest

from tests.serve.test_gateway import CALC, FAST_MT, _CallingStub, _ChatStub, _fast, _run, _run_bounded

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def stub():
    from tests.support.stub_engine_model import StubModel

    return StubModel(K=4, seed=1, eos_rate=0.3), _ChatStub()


def _gateway(model, tok, config, **kw):
    from ebpo.serve.gateway import AgentGateway
    from rollout.multiturn import MultiTurnConfig

    mt = MultiTurnConfig(**{**FAST_MT, **kw.pop("mt", {})})
    return AgentGateway(model, tok, config, mt, **kw)


def _config(**kw):
    from rollout import DecodeConfig

    return DecodeConfig.preset("quality", **{"temperature": 0.0, "max_new_tokens": 8, **kw})


# ---- the samples ---------------------------------------------------------------------------------------------

def _worker_sample(s):
    """The sample a RolloutWorker builds from the same trajectory (weights version 0: the gateway's)."""
    from rollout.trajectory import Trajectory
    from rollout.worker import _multi_turn_sample

    return _multi_turn_sample(Trajectory.from_dict(s["trajectory"]), 0)


def _one_episode(gw, agent, limit_s: float):
    """One episode of `agent` on the row {"prompt": "g"}, within `limit_s`; the gateway is closed afterwards:
    (its trajectory dict, seconds)."""
    try:
        samples, took = _run_bounded(gw, agent, [{"prompt": "g"}], limit_s=limit_s)
    finally:
        gw.close()
    return samples[0]["trajectory"], took


def test_samples_are_the_rollout_workers_multi_turn_samples(stub):
    """Every sample, a failed episode without turns included, is the dict a RolloutWorker returns for the same
    trajectory: the same keys and values (tpf, finished_by_eos, the last turn's text, lev_drafts, ...)."""
    async def agent(client, row):
        if row["i"] == 0:
            return 1.0  # no request: failed, no turns
        msgs = [{"role": "user", "content": row["prompt"]}]
        for _ in range(row["i"]):
            r = await client.chat.completions.create(model="p", messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]
        return 0.5

    gw = _fast(stub)
    try:
        samples = _run(gw, agent, n=6)
    finally:
        gw.close()
    for s in samples:
        assert s == _worker_sample(s)
    assert samples[0]["text"] == "" and samples[0]["trajectory"]["turns"] == []
    ends = [s["trajectory"]["turns"][-1]["finished_by"] for s in samples[1:]]
    assert "eos" in ends and set(ends) - {"eos"}, f"both endings needed (pick another stub seed): {ends}"
    assert any(s["num_forwards"] > 1 and s["tpf"] > 0 for s in samples)


def test_levenshtein_drafts_reach_the_sample_and_its_rewritten_segments():
    """With DELETE / INSERT on, a block's pre-edit draft is recorded at its offset from the end of the segment's
    prompt (a whole block: the offset plus the prompt length is a multiple of K), in the sample as in a
    RolloutWorker's, and in each rewritten segment."""
    from tests.support.stub_engine_model import StubModel

    K = 4

    async def agent(client, row):
        for c in ("gh", "hg", "gg"):  # each request rewrites: three segments, two of them rewritten
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": c}])
        return 1.0

    model = StubModel(K=K, seed=3, eos_rate=0.05, lev=True)
    gw = _gateway(model, _ChatStub(), _config(tau_delete=0.2, tau_insert=0.2, max_new_tokens=16),
                  mt={"max_turn_tokens": 16}, max_batch=4)
    try:
        s = _run(gw, agent, n=1)[0]
    finally:
        gw.close()
    t = s["trajectory"]
    assert s == _worker_sample(s)
    segments = t["segments"] + [t]
    assert len(segments) == 3 and [g["stop"] for g in t["segments"]] == ["rewritten"] * 2
    drafts = [(g, off, d) for g in segments for off, d in g["lev_drafts"]]
    assert drafts, "no DELETE / INSERT ran: pick another stub seed"
    assert any(g is not t for g, _, _ in drafts) and s["lev_drafts"]
    for g, off, d in drafts:
        assert off >= 0 and (off + len(g["prompt_ids"])) % K == 0 and len(d) == K


def test_how_a_failed_episode_is_recorded(stub):
    """The agent's exception, its type and message (cut to 200 characters), is the error, before or after its
    first request; a failed episode's lists are empty lists."""
    msg = "x" * 300

    async def agent(client, row):
        if row["i"] == 1:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        raise ValueError(msg)

    gw = _fast(stub)
    try:
        before, after = _run(gw, agent, n=2)
    finally:
        gw.close()
    want = "ValueError: " + "x" * 200
    for s, turns in ((before, 0), (after, 1)):
        t = s["trajectory"]
        assert t["failed"] and t["stop"] == "agent_error" and t["error"] == want and t["agent"] == {"error": want}
        assert len(t["turns"]) == turns and t["segments"] == [] and s["weights_version"] == 0
    t = before["trajectory"]
    assert (t["prompt_ids"], t["ids"], t["generated"], t["segment"]) == ([], [], [], [])


def test_an_episode_without_requests_is_an_agent_error_unless_its_time_ran_out():
    from ebpo.serve.gateway import Episode, episode_sample

    ep = Episode("e", {}, None, 2.0)
    t = episode_sample(ep, 1.0, None, time.monotonic(), 4)["trajectory"]  # hung is False by default
    assert (t["stop"], t["error"], t["failed"]) == ("agent_error", "the agent made no request", True)
    ep.expire()  # T passed before its first request; the agent returned before it was cancelled
    t = episode_sample(ep, 1.0, None, time.monotonic(), 4)["trajectory"]
    assert t["stop"] == "agent_timeout" and t["failed"] and t["env_reward"] == 0.0


def test_an_error_after_a_refused_rewrite_is_a_failure_and_the_episode_goes_on(stub):
    """A rewrite ends the current segment (recorded `rewritten`) even when its own messages are refused (400);
    the episode goes on (the next request is answered, from a new segment). `rewritten` is no limit: an agent
    that then raises has failed."""
    out = {}

    async def agent(client, row):
        msgs = [{"role": "user", "content": "g"}]
        r = await client.chat.completions.create(model="p", messages=msgs)
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "assistant", "content": "g"}])
        except openai.BadRequestError as e:
            out[row["i"]] = e.body["param"]
        if row["i"] == 0:
            raise KeyError("harness bug")
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]
        await client.chat.completions.create(model="p", messages=msgs)
        return 1.0

    gw = _fast(stub)
    try:
        raised, went_on = _run(gw, agent, n=2)
    finally:
        gw.close()
    assert out == {0: "messages", 1: "messages"}
    t = raised["trajectory"]
    assert t["failed"] and t["stop"] == "agent_error" and t["error"] == "KeyError: 'harness bug'"
    t = went_on["trajectory"]
    assert not t["failed"] and t["stop"] == "done" and t["env_reward"] == 1.0
    assert [g["stop"] for g in t["segments"]] == ["rewritten"] and len(t["turns"]) == 1


# ---- what the gateway sets up ----------------------------------------------------------------------------------

def test_the_engine_the_gateway_runs(stub):
    """max_batch 0 means 64 episodes decoding at once; the canvas holds max_total_tokens plus one block; the
    engine's own step timeout is only a backstop, 3 T + 10 s, behind the agent's clock (Episode.step_async)."""
    from ebpo.core.turns import round_up

    model, tok = stub
    T = 1.5
    for kw, batch in (({}, 64), ({"max_batch": 0}, 64), ({"max_batch": 3}, 3)):
        gw = _gateway(model, tok, _config(), mt={"step_timeout_s": T, "max_total_tokens": 90}, **kw)
        try:
            assert gw.driver.max_batch == batch and gw.driver.engine.max_batch == batch
            assert gw.driver.max_len == round_up(90 + 4, 4) == 96
            assert gw.driver.mt.step_timeout_s == 3 * T + 10.0
            assert gw.mt.step_timeout_s == T and gw.driver.mt.max_total_tokens == 90
        finally:
            gw.close()


def test_the_policy_name_is_served_and_defaults_to_policy(stub):
    """The response's `model` and `/v1/models` name the served policy: "policy" unless named."""
    seen = {}

    async def agent(client, row):
        r = await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "g"}])
        seen[row["i"]] = (r.model, [m.id for m in (await client.models.list()).data])
        return 1.0

    model, tok = stub
    for name, want in ((None, "policy"), ("mine", "mine")):
        gw = _gateway(model, tok, _config(), **({} if name is None else {"name": name}))
        try:
            _run(gw, agent)
        finally:
            gw.close()
        assert seen[0] == (want, [want])


def test_completion_ids_are_unique_across_episodes_and_runs(stub):
    """OpenAI's `id` identifies one chat completion: no two answers share one, in a run or across runs."""
    ids = []

    async def agent(client, row):
        msgs = [{"role": "user", "content": "g"}]
        for _ in range(2):
            r = await client.chat.completions.create(model="p", messages=msgs)
            ids.append(r.id)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]
        return 1.0

    gw = _fast(stub)
    try:
        for _ in range(2):
            _run(gw, agent, n=2)
    finally:
        gw.close()
    assert len(ids) == 8 and len(set(ids)) == 8


class _SlowRender(_ChatStub):
    """Records each encode's thread and how many run at once; each takes `delay` seconds."""

    def __init__(self, delay):
        super().__init__()
        self.delay, self.lock, self.now, self.most, self.threads = delay, threading.Lock(), 0, 0, set()

    def __call__(self, text, add_special_tokens=True):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.threads.add((threading.get_ident(), threading.current_thread().name))
        time.sleep(self.delay)
        with self.lock:
            self.now -= 1
        return super().__call__(text, add_special_tokens)


def test_requests_render_one_at_a_time_in_the_gateways_own_thread(stub):
    """Rendering runs off the event loop in one named thread, never two encodes at once (a fast tokenizer's
    encode is not reentrant), on a copy of the tokenizer that shares nothing with the engine's."""
    model, tok = stub
    gw = _fast(stub)
    try:
        assert gw.render_tokenizer is not tok and gw.render_tokenizer.inner is not tok.inner
        gw.render_tokenizer = slow = _SlowRender(0.05)

        async def agent(client, row):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
            return 1.0

        samples = _run(gw, agent, n=4)
    finally:
        gw.close()
    assert all(not s["trajectory"]["failed"] for s in samples)
    assert slow.most == 1 and len(slow.threads) == 1
    (ident, name), = slow.threads
    assert name.startswith("ebpo-gateway-render") and ident != threading.get_ident()


# ---- the agent's clock --------------------------------------------------------------------------------------

def test_the_clock_stops_while_a_request_is_answered(stub):
    """A request whose answer takes longer than T (here its rendering) does not expire the episode: the clock
    stops while it is answered."""
    gw = _fast(stub, step_timeout_s=0.3)
    gw.render_tokenizer = _SlowRender(0.8)

    async def agent(client, row):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        return 1.0

    t, _ = _one_episode(gw, agent, limit_s=30)
    assert t["stop"] == "done" and not t["failed"] and t["env_reward"] == 1.0 and len(t["turns"]) == 1


def test_a_request_more_than_t_after_the_answer_finds_the_episode_over(stub):
    """T after its answer the episode is over, not later: a request 1.3 T after it gets episode_over."""
    T = 0.5
    codes = []

    async def agent(client, row):
        msgs = [{"role": "user", "content": "g"}]
        r = await client.chat.completions.create(model="p", messages=msgs)
        await asyncio.sleep(1.3 * T)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]
        try:
            await client.chat.completions.create(model="p", messages=msgs)
        except openai.BadRequestError as e:
            codes.append(e.body["code"])
        return 1.0

    gw = _fast(stub, step_timeout_s=T)
    t, _ = _one_episode(gw, agent, limit_s=30)
    assert codes == ["episode_over"] and t["stop"] == "env_timeout" and not t["failed"] and len(t["turns"]) == 1


def test_an_agent_that_ignores_every_cancellation_is_abandoned(stub):
    """Cancelled at 2 T, an agent that swallows the cancellation is abandoned a second later; what it left gets
    one more cancellation and a second when the batch's loop closes: run returns in about 2 T + 2 s."""
    T = 0.3

    async def stubborn(client, row):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                continue

    gw = _fast(stub, step_timeout_s=T)
    t, took = _one_episode(gw, stubborn, limit_s=20)
    assert t["stop"] == "agent_timeout" and t["failed"] and len(t["turns"]) == 1
    # 2 T to the cancellation, 1 s for the agent to finish, 1 s more when the loop closes; + 1 s would be a mutant
    assert 2 * T + 2.0 <= took < 2 * T + 2.7, took


def test_first_turn_tool_calls_are_judged_against_the_requests_tools(stub):
    """The first request's `tools` judge the first turn's calls (a call of an offered tool is ok), and the
    returned calls have distinct ids and finish_reason tool_calls."""
    seen = {}

    async def agent(client, row):
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}],
                                                 tools=[CALC])
        seen[row["i"]] = r.choices[0]
        return 1.0

    model, _ = stub
    gw = _fast((model, _CallingStub()))
    try:
        samples = _run(gw, agent, n=4)
    finally:
        gw.close()
    called = [(s, seen[i]) for i, s in enumerate(samples)
              if _CallingStub.CALL in s["trajectory"]["turns"][0]["text"]]
    assert called, "no first turn called a tool: pick another stub seed"
    for s, choice in called:
        turn = s["trajectory"]["turns"][0]
        n = turn["text"].count("<tool_call>")
        assert [(c["name"], c["ok"]) for c in turn["tool_calls"]] == [("calc", True)] * n
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == n
        assert len({c.id for c in choice.message.tool_calls}) == n


# ---- OpenAI fields, retries, ends while a request waits ------------------------------------------------------

class _NoToolStub(_ChatStub):
    """The chat stub without a closing-tool-call token: a turn ends at EOS or at its budget."""

    def __init__(self):
        super().__init__()
        from tests.support.stub_engine_model import StubTokenizer

        self.inner = StubTokenizer(tool=None)


def test_a_turn_cut_by_its_budget_finishes_with_length_and_the_raw_choice_has_openais_fields():
    """OpenAI: finish_reason "length" when the token budget cut the answer; the response carries `created` (Unix
    seconds) and each choice `logprobs` (null: a diffusion policy has no per-token autoregressive log-probs)."""
    from tests.support.stub_engine_model import StubModel

    raw = {}

    async def agent(client, row):
        before = int(time.time())
        r = await client.chat.completions.with_raw_response.create(
            model="p", messages=[{"role": "user", "content": row["prompt"]}])
        raw[row["i"]] = (before, r.http_response.json(), int(time.time()))
        return 1.0

    gw = _gateway(StubModel(K=4, seed=1, eos_rate=0.0), _NoToolStub(), _config(), max_batch=4)
    try:
        samples = _run(gw, agent, n=2)
    finally:
        gw.close()
    for i, s in enumerate(samples):
        before, body, after = raw[i]
        assert s["trajectory"]["turns"][0]["finished_by"] == "budget"
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length" and "logprobs" in choice and choice["logprobs"] is None
        assert isinstance(body["created"], int) and before <= body["created"] <= after


def test_the_sample_of_a_one_forward_trajectory():
    """tpf is generated tokens per forward, also when one forward decoded them all (as a RolloutWorker's)."""
    from ebpo.serve.gateway import _sample
    from rollout.trajectory import Trajectory
    from rollout.worker import _multi_turn_sample

    def traj():
        return Trajectory(prompt_ids=[1, 2], ids=[1, 2, 3, 4, 5, 6], generated=[False, False] + [True] * 4,
                          segment=[0] * 6, turns=[], stop="done", num_forwards=1)

    s = _sample(traj(), [], {"reward": 1.0}, 0)
    assert s["tpf"] == 4.0
    ref = traj()
    ref.agent, ref.segments = {"reward": 1.0}, []
    assert s == _multi_turn_sample(ref, 0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failing engine thread
def test_a_request_waiting_when_the_engine_fails_gets_episode_over_not_a_hang(stub):
    """The engine fails while a request waits for its turn: the request gets episode_over naming the failure at
    once (nothing waits forever); the batch then fails with the engine's error."""
    from tests.support.stub_engine_model import StubModel

    class Failing(StubModel):
        def forward(self, *a, **kw):
            raise RuntimeError("device lost")

    got = []

    async def agent(client, row):
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
        except openai.BadRequestError as e:
            got.append((e.body["code"], e.body["message"]))
        return 1.0

    _, tok = stub
    gw = _gateway(Failing(K=4, seed=1), tok, _config(), max_batch=4)
    out = {}

    def go():
        try:
            gw.run(agent, [{"prompt": "g"}])
        except Exception as e:  # noqa: BLE001 - the batch's error is what the test reads
            out["error"] = e

    try:
        th = threading.Thread(target=go, daemon=True)
        th.start()
        th.join(30)
    finally:
        gw.close()
    assert not th.is_alive(), "the waiting request hung"
    assert len(got) == 1 and got[0][0] == "episode_over" and "device lost" in got[0][1]
    assert "device lost" in str(out.get("error"))


def test_a_limit_that_ends_the_sequence_under_a_waiting_request_logs_no_error(stub, caplog):
    """At the turn limit the sequence ends while the agent's next request waits: that request gets episode_over,
    and ending it raises nothing in the engine thread (no callback error logged)."""
    import logging

    async def talker(client, row):
        msgs = [{"role": "user", "content": row["prompt"]}]
        while True:
            r = await client.chat.completions.create(model="p", messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "h"}]

    gw = _fast(stub, max_turns=2)
    caplog.set_level(logging.ERROR)
    try:
        samples = _run(gw, talker, n=3, limit_s=30)
    finally:
        gw.close()
    assert all(s["trajectory"]["stop"] == "max_turns" and not s["trajectory"]["failed"] for s in samples)
    # a callback that raises is logged by concurrent.futures (and swallowed): the engine thread's error
    assert [r.getMessage() for r in caplog.records if r.name == "concurrent.futures"] == []


def _slow_model(delay):
    from tests.support.stub_engine_model import StubModel

    class Slow(StubModel):
        def forward(self, *a, **kw):
            time.sleep(delay)
            return super().forward(*a, **kw)

    return Slow(K=4, seed=1, eos_rate=0.0)


def test_an_agent_that_returns_while_its_request_decodes_ends_the_episode_at_that_turn(stub):
    """The agent returns with a request still decoding: its segment ends at that turn (stop done, not failed),
    at once, not at a timeout."""
    gw = _gateway(_slow_model(0.03), _NoToolStub(), _config(), max_batch=4, mt={"step_timeout_s": 0.5})

    async def agent(client, row):
        eid = str(client.base_url).split("/episodes/")[1].split("/")[0]
        asyncio.ensure_future(client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}]))
        while gw.episodes[eid].segment is None:
            await asyncio.sleep(0.005)
        return 1.0

    t, took = _one_episode(gw, agent, limit_s=30)
    assert t["stop"] == "done" and not t["failed"] and len(t["turns"]) == 1 and t["env_reward"] == 1.0
    assert took < 5.0, took


def test_a_request_the_agent_gives_up_on_ends_its_segment_at_that_turn(stub):
    """An agent that stops waiting for its request (cancels it) ends its segment at that turn: the episode's
    stop is done, not the timeout of a wait that T later ran out."""
    T = 0.5
    gw = _gateway(_slow_model(0.03), _NoToolStub(), _config(), max_batch=4, mt={"step_timeout_s": T})

    async def agent(client, row):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "g"}]), 0.1)
        await asyncio.sleep(1.5 * T)
        return 1.0

    t, took = _one_episode(gw, agent, limit_s=30)
    assert t["stop"] == "done" and not t["failed"] and len(t["turns"]) == 1 and t["env_reward"] == 1.0


def test_a_request_too_long_for_the_canvas_is_refused_and_the_batch_goes_on(stub):
    """A first request longer than the episode's canvas (max_total_tokens plus a block) gets a 400 naming the
    length; the episode goes on (after a second refusal, a shorter request is answered from a new segment) and so
    does the batch."""
    got = []

    async def agent(client, row):
        if row["i"] == 1:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g"}])
            return 1.0
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "g" * 300}])
        except openai.BadRequestError as e:
            got.append((e.body["code"], "does not fit" in e.body["message"]))
        try:  # a second refusal (nothing to answer) in a row
            await client.chat.completions.create(model="p", messages=[{"role": "assistant", "content": "g"}])
        except openai.BadRequestError as e:
            got.append((e.body["code"], e.body["param"]))
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "gh"}])
        return 0.5

    gw = _fast(stub)
    try:
        long, short = _run(gw, agent, n=2)
    finally:
        gw.close()
    assert got == [("episode_over", True), (None, "messages")]
    for s, reward in ((long, 0.5), (short, 1.0)):
        t = s["trajectory"]
        assert not t["failed"] and t["stop"] == "done" and t["env_reward"] == reward and len(t["turns"]) == 1
    assert long["trajectory"]["segments"] == []  # the refused segment never ran: nothing of it to train on
