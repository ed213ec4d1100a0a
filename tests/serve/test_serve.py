"""`ebpo serve` driven by the real `openai` client against uvicorn in a thread: chat, tools, n, seed (the tokens
of `ebpo generate`), errors in the OpenAI shape, and concurrent requests sharing forwards."""
import concurrent.futures
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

def chat_ids(tok, messages, tools=None):
    """Token ids of `messages` as `ebpo generate --chat` encodes a prompt (template text, then the tokenizer)."""
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


USER = [{"role": "user", "content": "Compute 482*37."}]
OPEN = [{"role": "user", "content": "Tell me a story about 7 cats."}]
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an integer expression.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}


def test_models_and_a_chat_completion_with_usage(served, client):
    service, _, _ = served
    assert [m.id for m in client.models.list().data] == ["tiny-agent"]
    r = client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "What is 2+3?"}],
                                       max_tokens=16, extra_body={"return_token_ids": True})
    ids = chat_ids(service.tokenizer, [{"role": "user", "content": "What is 2+3?"}])
    choice = r.choices[0]
    toks = choice.model_extra["token_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(toks) and 1 <= len(toks) <= 16
    assert r.usage.total_tokens == len(ids) + len(toks)
    assert r.usage.model_extra["forwards"] >= 2  # a 16-token answer takes at least one forward per block of 8
    assert choice.message.content == service.tokenizer.decode(toks, skip_special_tokens=True)
    eos = service.tokenizer.eos_token_id
    assert choice.finish_reason == ("stop" if toks[-1] == eos else "length")


def test_tool_calls_come_back_as_openai_tool_calls(served, client):
    service, _, _ = served
    r = client.chat.completions.create(model="tiny-agent", messages=USER, tools=[CALC], max_tokens=96,
                                       extra_body={"return_token_ids": True})
    choice = r.choices[0]
    text = service.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    # independent reading of what the model wrote: one <tool_call>{json}</tool_call>
    body = text[text.index("<tool_call>") + len("<tool_call>"): text.index("</tool_call>")]
    call = json.loads(body)
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    got = choice.message.tool_calls[0]
    assert got.type == "function" and got.function.name == call["name"] == "calc"
    assert json.loads(got.function.arguments) == call["arguments"]
    assert "<tool_call>" not in (choice.message.content or "")


def test_n_choices_with_a_seed_are_the_tokens_of_ebpo_generate(served, client, capsys):
    from rollout.cli import main as generate_main

    r = client.chat.completions.create(model="tiny-agent", messages=OPEN, n=3, seed=11, temperature=2.0,
                                       max_tokens=24, extra_body={"return_token_ids": True})
    served_ids = [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]
    capsys.readouterr()
    # ebpo generate: sequence i of the call uses seed + i, as choice i does
    assert generate_main(["--model", "tiny-agent", "--chat", "--json", "--temperature", "2.0", "--seed", "11",
                          "--max-new-tokens", "24"] + ["--prompt", OPEN[0]["content"]] * 3) == 0
    generated = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert served_ids == generated
    assert len({tuple(x) for x in served_ids}) > 1, "three seeds, three different samples"
    again = client.chat.completions.create(model="tiny-agent", messages=OPEN, n=1, seed=12, temperature=2.0,
                                           max_tokens=24, extra_body={"return_token_ids": True})
    assert again.choices[0].model_extra["token_ids"] == served_ids[1], "choice 1 of seed 11 is seed 12"


@pytest.mark.parametrize("kwargs, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=USER, n=0), "n"),
    (dict(messages=USER, n=99), "n"),
    (dict(messages=USER, temperature=-1), "temperature"),
    (dict(messages=USER, max_tokens=100000), "max_tokens"),
    (dict(messages=USER, stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(messages=USER, extra_body={"stream": "yes"}), "stream"),
    (dict(messages=USER, logit_bias={"5": 1}), "logit_bias"),
    (dict(messages=USER, logprobs=True), "logprobs"),  # a diffusion policy has none to give (docs/serving.md)
    (dict(messages=USER, logprobs=True, top_logprobs=2), "logprobs"),
    (dict(messages=USER, tools=[{"type": "function"}]), "tools"),
    (dict(messages=USER, extra_body={"mode": "turbo"}), "mode"),
    (dict(messages=USER, extra_body={"tau_mask": 3.0}), "tau_mask"),
    (dict(messages=USER + [{"role": "assistant", "content": "x"}]), "messages"),
])
def test_bad_requests_get_openai_shaped_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-agent", **kwargs)
    assert err.value.status_code == 400
    body = err.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == param and body["message"]


def test_unknown_model_route_bad_json_and_a_too_long_prompt(served, client):
    _, _, live = served
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert err.value.body["code"] == "model_not_found"
    raw = httpx.post(live.base_url + "/chat/completions", content=b"{not json", timeout=30,
                     headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    missing = httpx.get(live.base_url + "/nothing-here", timeout=30)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "x" * 600}],
                                       max_tokens=8)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:  # tiny-agent has no DELETE / INSERT tokens
        client.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=8, extra_body={"tau_delete": 0.5})
    assert err.value.body["param"] == "tau_delete" and "delete_token_id" in err.value.body["message"]
    # the server is still up and answering
    assert client.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=8).choices


def test_stop_strings_cut_the_text(served, client):
    service, _, _ = served
    r = client.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=24,
                                       extra_body={"return_token_ids": True})
    full = service.tokenizer.decode(r.choices[0].model_extra["token_ids"], skip_special_tokens=True)
    stop = full[5:8]
    cut = client.chat.completions.create(model="tiny-agent", messages=USER, max_tokens=24, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_concurrent_requests_share_forwards_and_keep_their_tokens(served, client):
    """8 requests at once: the engine runs fewer forwards than the requests' own forwards added up (each
    request's usage counts the forwards its sequence took part in, alone or not), and every request gets the
    tokens `rollout.generate` gives its prompt."""
    import torch

    from rollout import DecodeConfig, generate

    service, driver, _ = served
    questions = [f"Compute {100 + 7 * i}*{13 + i}." for i in range(8)]

    def ask(q):
        return client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": q}],
                                              max_tokens=32, extra_body={"return_token_ids": True})

    before = driver.num_forwards
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, questions))
    engine_forwards = driver.num_forwards - before
    own = sum(r.usage.model_extra["forwards"] for r in results)
    assert engine_forwards < own / 2, (engine_forwards, own)
    prompts = [chat_ids(service.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    with torch.no_grad():
        ref = generate(service.model, prompts, DecodeConfig.preset("quality", max_new_tokens=32))
    assert [r.choices[0].model_extra["token_ids"] for r in results] == [o.token_ids for o in ref]
