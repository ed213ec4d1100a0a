"""ebpo.serve.schema: the request body -> ChatRequest, and every refusal in the OpenAI error shape.

Written from the module docstring, docs/serving.md and the OpenAI chat-completions API: which fields are
read and how, which are refused (HTTP 400, `param` naming the field) and which pass. Pure: no model, no server."""
import json

import pytest

from ebpo.serve.schema import (DEFAULT_MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_N, MAX_STOP, ChatRequest, RequestError,
                               check_json, decode_body, parse_messages, parse_request, parse_tools)
from rollout.config import PRESETS, DecodeConfig

DEFAULT = DecodeConfig(max_new_tokens=48, temperature=0.0)
LIMIT = 100
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "calc", "description": "adds",
                                         "parameters": {"type": "object", "properties": {}}}}


def body(**fields):
    return {"model": "m", "messages": USER, **fields}


def refused(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


def parse(**fields) -> ChatRequest:
    return parse_request(body(**fields), DEFAULT, LIMIT)


# ---- the error shape ----------------------------------------------------------------------------------------

def test_a_request_error_is_the_openai_error_object():
    e = RequestError("n must be ...", "n", "bad_n", status=429, type="rate_limit_error", headers={"Retry-After": "1"})
    assert e.body() == {"error": {"message": "n must be ...", "type": "rate_limit_error", "param": "n",
                                  "code": "bad_n"}}
    assert (e.status, e.headers, str(e)) == (429, {"Retry-After": "1"}, "n must be ...")
    d = RequestError("bad")
    assert (d.status, d.type, d.param, d.code, d.headers) == (400, "invalid_request_error", None, None, None)


def test_the_documented_limits():
    assert (MAX_N, MAX_STOP, MAX_JSON_DEPTH) == (16, 4, 32)
    assert DEFAULT_MAX_BODY_BYTES == 4 * 1024 * 1024


# ---- decode_body / check_json ------------------------------------------------------------------------------

def nested(depth: int, leaf=0, key=None):
    """A JSON value with `depth` arrays (or objects under `key`) inside each other."""
    v = leaf
    for _ in range(depth):
        v = {key: v} if key else [v]
    return v


def test_decode_body_returns_the_json_value():
    raw = json.dumps(body(stop=["x"])).encode()
    assert decode_body(raw) == body(stop=["x"])
    assert decode_body("{\"model\": \"é\"}".encode()) == {"model": "é"}


@pytest.mark.parametrize("raw, code, starts", [
    (b"\xff\xfe{}", "invalid_json", "the request body is not UTF-8"),
    (b"{\"model\": ", "invalid_json", "the request body is not valid JSON"),
    (b"[" * 10_000 + b"]" * 10_000, "too_deep", f"the request nests deeper than {MAX_JSON_DEPTH} levels"),
    (json.dumps({"messages": [{"content": "\ud800"}]}).encode(), "invalid_text", "a string holds a lone UTF-16"),
])
def test_decode_body_refuses_what_no_field_check_would_see(raw, code, starts):
    e = refused(decode_body, raw)
    assert (e.status, e.code, e.type) == (400, code, "invalid_request_error")
    assert e.message.startswith(starts), e.message


def test_the_depth_limit_is_exactly_max_json_depth():
    check_json(nested(MAX_JSON_DEPTH))  # 32 arrays inside each other: allowed
    check_json({"tools": nested(MAX_JSON_DEPTH - 1, key="k")})
    e = refused(check_json, nested(MAX_JSON_DEPTH + 1))
    assert (e.code, e.param) == ("too_deep", None)
    assert e.message == f"the request nests deeper than {MAX_JSON_DEPTH} levels"
    e = refused(check_json, {"tools": nested(MAX_JSON_DEPTH, key="k")})
    assert (e.code, e.param) == ("too_deep", "tools")  # named by its top-level field


def test_a_deep_value_is_checked_without_recursion():
    deep = nested(50_000)
    assert refused(check_json, deep).code == "too_deep"


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "\udc00"])
def test_a_lone_surrogate_anywhere_is_refused_and_named_by_its_top_level_field(text):
    e = refused(check_json, {"model": "m", "messages": [{"role": "user", "content": text}]})
    assert (e.code, e.param, e.status) == ("invalid_text", "messages", 400)
    assert e.message.startswith("a string holds a lone UTF-16 surrogate")
    e = refused(check_json, {"metadata": {text: 1}})  # in a key
    assert (e.code, e.param) == ("invalid_text", "metadata")
    assert e.message.startswith("a key holds a lone UTF-16 surrogate")
    e = refused(check_json, {text: 1})  # a top-level key: nothing above it to name
    assert (e.code, e.param) == ("invalid_text", None)
    e = refused(check_json, [text])
    assert (e.code, e.param) == ("invalid_text", None)


@pytest.mark.parametrize("after", ["ok", 1, None, 2.5, True])
def test_every_value_is_checked_whatever_comes_before_it(after):
    """The scan goes on past plain values (strings, numbers, null, booleans) to the ones after them."""
    assert refused(check_json, ["\ud800", after]).code == "invalid_text"
    assert refused(check_json, {"a": nested(MAX_JSON_DEPTH), "b": after}).code == "too_deep"
    assert refused(check_json, {"messages": [{"content": "\udfff"}], "model": after}).param == "messages"


def test_valid_text_passes_the_check():
    check_json({"model": "m", "messages": [{"role": "user", "content": "\U0001F600 ✓ é \ue000"}], "n": 1.5,
                "x": [None, True, 3]})


# ---- messages ----------------------------------------------------------------------------------------------

def test_messages_are_validated_into_text_turns():
    out = parse_messages([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}},
                        {"function": {"name": "calc"}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "ignored"},
        {"role": "assistant", "content": "done"},
    ])
    assert out == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}},
                        {"id": None, "type": "function", "function": {"name": "calc", "arguments": ""}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]


def test_dict_arguments_of_a_sent_tool_call_are_kept():
    out = parse_messages([{"role": "assistant", "content": "x",
                           "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}, *USER])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


@pytest.mark.parametrize("messages, param, starts", [
    (None, "messages", "messages must be a non-empty list"),
    ([], "messages", "messages must be a non-empty list"),
    ({"role": "user"}, "messages", "messages must be a non-empty list"),
    (["hi"], "messages", "messages[0] must be an object"),
    ([{"content": "x"}], "messages[0].role", "messages[0].role must be one of"),
    ([*USER, {"role": "developer", "content": "x"}], "messages[1].role", "messages[1].role must be one of"),
    ([{"role": "user", "content": 3}], "messages[0].content", "messages[0].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content",
     "messages[0].content[0]: only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content",
     "messages[0].content[0]: only text parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content", "messages[0].content[0]: only text"),
    ([{"role": "user", "content": ["text"]}], "messages[0].content", "messages[0].content[0]: only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "img"}]}], "messages[0].content",
     "messages[0].content[1]: only text parts"),
    ([{"role": "assistant", "content": "", "tool_calls": {"function": {}}}], "messages[0].tool_calls",
     "messages[0].tool_calls must be a list"),
    ([{"role": "assistant", "tool_calls": ["x"]}], "messages[0].tool_calls", "messages[0].tool_calls[0] needs"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "messages[0].tool_calls",
     "messages[0].tool_calls[0] needs function.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}], "messages[0].tool_calls",
     "messages[0].tool_calls[0] needs"),
    ([{"role": "assistant", "tool_calls": [{"function": "f"}]}], "messages[0].tool_calls",
     "messages[0].tool_calls[0] needs"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}},
                                           {"function": {"name": "f", "arguments": 3}}]}],
     "messages[0].tool_calls", "messages[0].tool_calls[1] needs function.name and function.arguments"),
])
def test_bad_messages_are_refused_naming_the_first_bad_one(messages, param, starts):
    e = refused(parse_messages, messages)
    assert (e.param, e.status, e.type) == (param, 400, "invalid_request_error")
    assert e.message.startswith(starts), e.message


def test_the_role_refusal_lists_the_roles():
    e = refused(parse_messages, [{"role": "bot", "content": "x"}])
    assert e.message == "messages[0].role must be one of ['system', 'user', 'assistant', 'tool'], got 'bot'"


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
def test_each_openai_role_is_accepted(role):
    assert parse_messages([{"role": role, "content": "x"}])[0]["role"] == role


# ---- tools -------------------------------------------------------------------------------------------------

def test_tools_pass_through_and_an_empty_list_is_no_tools():
    assert parse_tools(None) is None
    assert parse_tools([]) is None
    minimal = {"type": "function", "function": {"name": "f"}}
    assert parse_tools([TOOL, minimal]) == [TOOL, minimal]


@pytest.mark.parametrize("tools, starts", [
    ({"type": "function"}, "tools must be a list"),
    (["calc"], "tools[0] must be"),
    ([{"type": "code_interpreter"}], "tools[0] must be"),
    ([{"type": "function", "function": "calc"}], "tools[0] must be"),
    ([{"function": {"name": "calc"}}], "tools[0] must be"),
    ([TOOL, {"type": "function", "function": {"description": "no name"}}], "tools[1] must be"),
    ([{"type": "function", "function": {"name": 1}}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{\"type\": \"object\"}"}}],
     "tools[0].function.parameters must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools[0].function.parameters must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     "tools[0].function.description must be a string"),
])
def test_bad_tools_are_refused(tools, starts):
    e = refused(parse_tools, tools)
    assert (e.param, e.status) == ("tools", 400)
    assert e.message.startswith(starts), e.message


# ---- the whole request -------------------------------------------------------------------------------------

def test_a_minimal_request_takes_the_server_defaults():
    r = parse()
    assert r == ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], config=DEFAULT)
    assert (r.n, r.seed, r.stop, r.tools, r.tool_choice, r.stream, r.include_usage, r.return_token_ids) == (
        1, None, [], None, "auto", False, False, False)


def test_every_supported_field_is_read():
    r = parse(tools=[TOOL], tool_choice="none", n=3, seed=7, temperature=1.5, top_p=0.9, max_tokens=20,
              stop=["\n\n", "END"], stream=True, stream_options={"include_usage": True}, return_token_ids=True,
              tau_mask=0.8, tau_edit=None, tau_delete=0.3, tau_insert=0.4, mbe_window=2, top_k=5,
              user="u", metadata={"a": "b"}, store=False, parallel_tool_calls=True, service_tier="auto",
              frequency_penalty=0, presence_penalty=0.0, logprobs=False)
    assert (r.n, r.seed, r.stop, r.tools, r.tool_choice, r.stream, r.include_usage, r.return_token_ids) == (
        3, 7, ["\n\n", "END"], [TOOL], "none", True, True, True)
    assert r.config == DEFAULT.replace(temperature=1.5, top_p=0.9, max_new_tokens=20, tau_mask=0.8, tau_edit=None,
                                       tau_delete=0.3, tau_insert=0.4, mbe_window=2, top_k=5)
    assert isinstance(r.config.temperature, float)


def test_a_stop_string_is_a_list_of_one():
    assert parse(stop="END").stop == ["END"]
    assert parse(stop=None).stop == []
    assert parse(stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]


def test_max_completion_tokens_is_max_tokens_and_max_tokens_wins():
    assert parse(max_completion_tokens=9).config.max_new_tokens == 9
    assert parse(max_tokens=7, max_completion_tokens=9).config.max_new_tokens == 7
    assert parse(max_tokens=LIMIT).config.max_new_tokens == LIMIT
    assert parse(max_tokens=1).config.max_new_tokens == 1
    assert parse(max_tokens=None).config.max_new_tokens == DEFAULT.max_new_tokens


@pytest.mark.parametrize("mode", sorted(PRESETS))
def test_mode_is_a_preset_that_keeps_the_server_length_and_temperature(mode):
    default = DecodeConfig(max_new_tokens=33, temperature=0.7, tau_mask=0.6, top_k=3)
    r = parse_request(body(mode=mode), default, LIMIT)
    assert r.config == DecodeConfig.preset(mode, max_new_tokens=33, temperature=0.7)
    r = parse_request(body(mode=mode, temperature=0.2, tau_mask=0.99), default, LIMIT)
    assert r.config == DecodeConfig.preset(mode, max_new_tokens=33, temperature=0.2, tau_mask=0.99)
    assert parse_request(body(mode=None), default, LIMIT).config == default


def test_boundary_values_are_accepted():
    assert parse(n=MAX_N).n == MAX_N
    assert parse(n=1).n == 1
    assert parse(n=None).n == 1
    assert parse(seed=0).seed == 0
    assert parse(seed=2 ** 63 - 1).seed == 2 ** 63 - 1
    assert parse(temperature=0).config.temperature == 0.0
    assert parse(temperature=2).config.temperature == 2.0
    assert parse(temperature=None).config.temperature == DEFAULT.temperature
    assert parse(top_p=None).config.top_p == DEFAULT.top_p
    assert parse(tool_choice=None).tool_choice == "auto"
    assert parse(tool_choice="auto").tool_choice == "auto"
    assert parse(stream=False).stream is False
    assert parse(stream=None).stream is False
    assert parse(return_token_ids=False).return_token_ids is False
    assert parse(stream=True, stream_options={}).include_usage is False
    assert parse(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert parse(stream=True).include_usage is False
    assert parse(stream_options=None).include_usage is False


@pytest.mark.parametrize("fields, param, code, starts", [
    (dict(n=0), "n", None, f"n must be an integer in [1, {MAX_N}]"),
    (dict(n=MAX_N + 1), "n", None, "n must be an integer"),
    (dict(n=2.0), "n", None, "n must be an integer"),
    (dict(n=True), "n", None, "n must be an integer"),
    (dict(seed=-1), "seed", None, "seed must be an integer in [0, 2**63)"),
    (dict(seed=2 ** 63), "seed", None, "seed must be an integer"),
    (dict(seed="1"), "seed", None, "seed must be an integer"),
    (dict(seed=False), "seed", None, "seed must be an integer"),
    (dict(temperature=2.01), "temperature", None, "temperature must be a number in [0, 2]"),
    (dict(temperature=-0.1), "temperature", None, "temperature must be a number"),
    (dict(temperature="1"), "temperature", None, "temperature must be a number"),
    (dict(temperature=True), "temperature", None, "temperature must be a number"),
    (dict(max_tokens=0), "max_tokens", None, f"max_tokens must be an integer in [1, {LIMIT}]"),
    (dict(max_tokens=LIMIT + 1), "max_tokens", None, "max_tokens must be an integer"),
    (dict(max_tokens=8.0), "max_tokens", None, "max_tokens must be an integer"),
    (dict(max_tokens=True), "max_tokens", None, "max_tokens must be an integer"),
    (dict(max_completion_tokens=LIMIT + 1), "max_tokens", None, "max_tokens must be an integer"),
    (dict(mode="fast"), "mode", None, "mode must be one of ['m2t', 'quality', 'speed'], got 'fast'"),
    (dict(top_p=0), "top_p", None, "DecodeConfig.top_p"),
    (dict(top_k=-1), "top_k", None, "DecodeConfig.top_k"),
    (dict(tau_mask=1.5), "tau_mask", None, "DecodeConfig.tau_mask"),
    (dict(mbe_window="2"), "mbe_window", None, "DecodeConfig.mbe_window"),
    (dict(stop=""), "stop", None, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them"),
    (dict(stop=["a", ""]), "stop", None, "stop must be"),
    (dict(stop=["a", 1]), "stop", None, "stop must be"),
    (dict(stop=["a"] * (MAX_STOP + 1)), "stop", None, "stop must be"),
    (dict(stop=7), "stop", None, "stop must be"),
    (dict(stop={"a": 1}), "stop", None, "stop must be"),
    (dict(stream="yes"), "stream", None, "stream must be true or false"),
    (dict(stream=1), "stream", None, "stream must be true or false"),
    (dict(stream=True, stream_options={"include_usage": 1}), "stream_options", None,
     "stream_options may only hold include_usage (true or false)"),
    (dict(stream=True, stream_options={"include_usage": True, "x": 1}), "stream_options", None,
     "stream_options may only hold"),
    (dict(stream=True, stream_options=["include_usage"]), "stream_options", None, "stream_options may only hold"),
    (dict(stream_options={"include_usage": True}), "stream_options", None,
     "stream_options is only allowed with stream=true"),
    (dict(stream=False, stream_options={"include_usage": False}), "stream_options", None,
     "stream_options is only allowed with stream=true"),
    (dict(model=None), "model", None, "model must be a string"),
    (dict(model=3), "model", None, "model must be a string"),
    (dict(tool_choice="required"), "tool_choice", "unsupported_value",
     "tool_choice: only 'auto' and 'none' are supported"),
    (dict(tool_choice={"type": "function", "function": {"name": "calc"}}), "tool_choice", "unsupported_value",
     "tool_choice: only"),
    (dict(return_token_ids="true"), "return_token_ids", None, "return_token_ids must be true or false"),
    (dict(return_token_ids=1), "return_token_ids", None, "return_token_ids must be true or false"),
    (dict(logprobs=True), "logprobs", "unsupported_parameter", "logprobs is not supported by this server"),
    (dict(frequency_penalty=0.5), "frequency_penalty", "unsupported_parameter", "frequency_penalty is not"),
    (dict(presence_penalty=1), "presence_penalty", "unsupported_parameter", "presence_penalty is not"),
    (dict(top_logprobs=2), "top_logprobs", "unsupported_parameter", "top_logprobs is not supported"),
    (dict(response_format={"type": "json_object"}), "response_format", "unsupported_parameter",
     "response_format is not supported"),
    (dict(functions=[]), "functions", "unsupported_parameter", "functions is not supported"),
    (dict(mbe_tau=0.5), "mbe_tau", "unsupported_parameter", "mbe_tau is not supported"),
])
def test_bad_or_unsupported_fields_are_refused_naming_the_field(fields, param, code, starts):
    e = refused(parse_request, body(**fields), DEFAULT, LIMIT)
    assert (e.param, e.code, e.status, e.type) == (param, code, 400, "invalid_request_error")
    assert e.message.startswith(starts), e.message


def test_a_neutral_field_does_not_let_an_unknown_one_after_it_pass():
    e = refused(parse_request, {"frequency_penalty": 0, "logprobs": False, "bogus": 1, **body()}, DEFAULT, LIMIT)
    assert (e.param, e.code) == ("bogus", "unsupported_parameter")


def test_neutral_values_of_unimplemented_fields_pass():
    """frequency_penalty / presence_penalty 0 and logprobs false (or null) cannot change the result."""
    for key, value in [("frequency_penalty", 0), ("frequency_penalty", None), ("presence_penalty", 0.0),
                       ("logprobs", False), ("logprobs", None)]:
        assert parse(**{key: value}).config == DEFAULT, key


def test_the_body_must_be_an_object_and_hold_messages():
    for raw in ([body()], "x", None, 3):
        e = refused(parse_request, raw, DEFAULT, LIMIT)
        assert (e.param, e.status, e.message) == (None, 400, "the request body must be a JSON object")
    e = refused(parse_request, {"model": "m"}, DEFAULT, LIMIT)
    assert e.param == "messages"
    e = refused(parse_request, {"messages": USER}, DEFAULT, LIMIT)
    assert e.param == "model"
    e = refused(parse_request, body(tools="calc"), DEFAULT, LIMIT)
    assert e.param == "tools"


def test_a_decode_config_error_without_a_named_field_has_no_param(monkeypatch):
    """A DecodeConfig refusal that names no field of the request: the message passes, the param is None."""
    import ebpo.serve.schema as schema

    def bad_replace(self, **over):
        raise TypeError("something else went wrong")

    monkeypatch.setattr(schema.DecodeConfig, "replace", bad_replace)
    e = refused(parse_request, body(top_k=2), DEFAULT, LIMIT)
    assert (e.param, e.message) == (None, "something else went wrong")
