"""ebpo.serve.render: chat messages -> token ids in the training layout, and model text -> an assistant message.

A character tokenizer (one id per character, a visible chat template) makes the expected ids readable: each
expectation is built from the module docstring's rules (head through the template with the tools, assistant
turns as text + EOS padded with EOS to a block boundary, tool runs joined by newlines in the observation
template, later user / system messages through the template alone), not from the module's output."""
import json

import pytest

from ebpo.core.turns import OBSERVATION_TEMPLATE
from ebpo.serve.render import (assistant_message, assistant_text, call_text, extension_ids, prompt_ids,
                               same_assistant, tool_call_records)

EOS = 0


class CharTokenizer:
    """id = code point; the chat template writes `<tools=a,b>` then `[role]content` per message, then `[A]`."""

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # the layout adds no BOS/EOS of its own
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        assert tokenize is False
        head = f"<tools={','.join(t['function']['name'] for t in tools)}>" if tools else ""
        body = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return head + body + ("[A]" if add_generation_prompt else "")


TOK = CharTokenizer()
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}, "digits": {"type": "integer"}},
    "required": ["expr"]}}}, {"type": "function", "function": {"name": "now"}}]


def ids(text):
    return [ord(c) for c in text]


def padded(seq, k):
    """seq + EOS up to the next multiple of k (none when already on one)."""
    return seq + [EOS] * (-len(seq) % k)


def call(name, arguments, cid="c"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- messages -> ids ---------------------------------------------------------------------------------------

def test_a_conversation_without_assistant_turns_is_the_template_with_the_generation_prompt():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert prompt_ids(TOK, msgs, TOOLS, 4, EOS) == ids("<tools=calc,now>[system]s[user]q[A]")
    assert prompt_ids(TOK, msgs, None, 4, EOS) == ids("[system]s[user]q[A]")


@pytest.mark.parametrize("k", [1, 4, 5, 32])
def test_a_multi_turn_conversation_is_laid_out_as_training_lays_it_out(k):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "let me", "tool_calls": [call("calc", "{\"expr\": \"1+1\"}")]},
            {"role": "tool", "content": "2"}, {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "it is 2"},
            {"role": "user", "content": "thanks"}]
    head = ids("<tools=calc,now>[user]q[A]")
    turn1 = ids("let me\n<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": "1+1"}}) + "</tool_call>")
    obs = ids(OBSERVATION_TEMPLATE.format(observation="2\nok"))
    turn2 = ids("it is 2")
    user = ids("[user]thanks[A]")
    want = padded(head + turn1 + [EOS], k)  # the assistant turn ends with EOS and fills its block with EOS
    want = padded(want + obs + turn2 + [EOS], k)
    want = want + user  # the last segment (a prompt) is not padded
    assert prompt_ids(TOK, msgs, TOOLS, k, EOS) == want


def test_an_assistant_turn_that_ends_on_a_block_boundary_gets_no_filler():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"},
            {"role": "user", "content": "r"}]
    head = ids("[user]q[A]")  # 10 ids
    k = len(head) + 4  # head + "abc" + EOS ends exactly on the boundary
    assert prompt_ids(TOK, msgs, None, k, EOS) == head + ids("abc") + [EOS] + ids("[user]r[A]")


def test_each_run_of_messages_between_assistant_turns_is_one_extension():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "x"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "r"}, {"role": "tool", "content": "y"}]
    want = ids("[user]q[A]") + ids("a") + [EOS] + ids(OBSERVATION_TEMPLATE.format(observation="x")) + ids("b") + [EOS]
    want = want + ids("[user]r[A]") + ids(OBSERVATION_TEMPLATE.format(observation="y"))
    assert prompt_ids(TOK, msgs, None, 1, EOS) == want


def test_the_observation_template_is_the_callers():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "x"}]
    got = prompt_ids(TOK, msgs, None, 1, 7, observation_template="<obs>{observation}</obs>")
    assert got == ids("[user]q[A]") + ids("a") + [7] + ids("<obs>x</obs>")


def test_a_conversation_ending_with_an_assistant_message_is_refused():
    with pytest.raises(ValueError, match="^the last message is an assistant message: there is nothing to answer$"):
        prompt_ids(TOK, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], None, 4, EOS)


def test_extension_ids_of_tool_results_and_a_new_user_message():
    ext = [{"role": "tool", "content": "1"}, {"role": "user", "content": "more"}, {"role": "system", "content": "s"},
           {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}]
    want = (ids(OBSERVATION_TEMPLATE.format(observation="1")) + ids("[user]more[A]") + ids("[system]s[A]")
            + ids(OBSERVATION_TEMPLATE.format(observation="2\n3")))
    assert extension_ids(TOK, ext) == want
    assert extension_ids(TOK, [{"role": "tool", "content": "z"}], "({observation})") == ids("(z)")


ENDS = "^the messages after an assistant turn must end with a user or tool message$"


@pytest.mark.parametrize("msgs, match", [
    ([], ENDS),
    ([{"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}], ENDS),
    ([{"role": "user", "content": "1"}, {"role": "system", "content": "s"}], ENDS),
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}],
     "^extension_ids: an assistant message is not an extension$"),
])
def test_extension_ids_refuses_what_is_not_an_extension(msgs, match):
    with pytest.raises(ValueError, match=match):
        extension_ids(TOK, msgs)


# ---- assistant messages -> text ----------------------------------------------------------------------------

def test_call_text_writes_the_calls_as_the_model_writes_them():
    calls = [call("calc", "{\"expr\": \"2*3\"}"), call("now", ""), call("calc", {"expr": "1"}), call("f", "  "),
             call("g", "not json"), {"function": {"name": "h"}}]
    want = "".join("<tool_call>" + json.dumps(c) + "</tool_call>" for c in [
        {"name": "calc", "arguments": {"expr": "2*3"}}, {"name": "now", "arguments": {}},
        {"name": "calc", "arguments": {"expr": "1"}}, {"name": "f", "arguments": {}},
        {"name": "g", "arguments": "not json"}, {"name": "h", "arguments": {}}])
    assert call_text(calls) == want
    assert call_text([]) == ""


def test_assistant_text_joins_content_and_calls_with_a_newline_only_when_both_are_there():
    c = [call("now", "{}")]
    calls = "<tool_call>" + json.dumps({"name": "now", "arguments": {}}) + "</tool_call>"
    assert assistant_text({"content": "hi", "tool_calls": c}) == "hi\n" + calls
    assert assistant_text({"content": "", "tool_calls": c}) == calls
    assert assistant_text({"content": None, "tool_calls": c}) == calls
    assert assistant_text({"content": "hi", "tool_calls": None}) == "hi"
    assert assistant_text({"content": "hi"}) == "hi"
    assert assistant_text({}) == ""


# ---- model text -> an assistant message --------------------------------------------------------------------

def test_text_without_calls_is_the_content():
    assert assistant_message("The answer is 4.", ["x"]) == (
        {"role": "assistant", "content": "The answer is 4.", "tool_calls": None}, False)


def test_tool_calls_are_parsed_out_of_the_text_in_order_with_the_given_ids():
    text = ("I will compute.\n<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"6*7\"}}</tool_call>\n"
            "<tool_call>{\"name\": \"now\", \"arguments\": \"{}\"}</tool_call>  ")
    msg, has_calls = assistant_message(text, ["id0", "id1", "id2"])
    assert has_calls is True
    assert msg["role"] == "assistant"
    assert msg["content"] == "I will compute."  # the calls cut out, outer whitespace stripped
    assert [(c["id"], c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("id0", "function", "calc", {"expr": "6*7"}),
                                            ("id1", "function", "now", {})]
    assert all(isinstance(c["function"]["arguments"], str) for c in msg["tool_calls"])  # OpenAI: a JSON string


def test_a_message_of_only_calls_has_null_content():
    msg, has_calls = assistant_message(" <tool_call>{\"name\": \"now\"}</tool_call>\n", ["a"])
    assert has_calls and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_each_call_is_cut_out_once_where_it_stands():
    body = "<tool_call>{\"name\": \"now\"}</tool_call>"
    msg, _ = assistant_message(body + "x" + body + "y" + body, ["a", "b", "c"])
    assert msg["content"] == "xy"
    assert [c["id"] for c in msg["tool_calls"]] == ["a", "b", "c"]
    msg, _ = assistant_message("a" + body + "b" + body + "c", ["a", "b"])
    assert msg["content"] == "abc"


@pytest.mark.parametrize("text", [
    "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"1\"}}",  # never closed
    "<tool_call>{not json}</tool_call>",
    "<tool_call>{\"arguments\": {}}</tool_call>",
    "ok <tool_call>{\"name\": \"now\"}</tool_call> <tool_call>[1]</tool_call>",  # one good, one bad
])
def test_a_malformed_call_stays_in_the_content(text):
    assert assistant_message(text, ["a", "b"]) == ({"role": "assistant", "content": text, "tool_calls": None}, False)


# ---- tool-call records (the gateway's turns) ---------------------------------------------------------------

def record(name, arguments, error=None):
    return {"name": name, "arguments": arguments, "ok": error is None, "error": error, "invalid": error is not None,
            "timeout": False, "latency_s": 0.0, "result": None}


def test_tool_call_records_judge_each_call_against_the_request_tools():
    text = ("<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"1\", \"digits\": 2}}</tool_call>"
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"digits\": 2}}</tool_call>"
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": 1}}</tool_call>"
            "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>"
            "<tool_call>{\"name\": \"now\"}</tool_call>")
    assert tool_call_records(text, TOOLS) == [
        record("calc", {"expr": "1", "digits": 2}),
        record("calc", {"digits": 2}, "missing argument 'expr'"),
        record("calc", {"expr": 1}, "argument 'expr' must be string"),
        record("search", {}, "unknown tool 'search'"),
        record("now", {}),
    ]


def test_tool_call_records_of_malformed_calls_and_no_tools():
    recs = tool_call_records("<tool_call>{oops}</tool_call>", TOOLS)
    assert len(recs) == 1 and recs[0]["name"] is None and recs[0]["arguments"] is None
    assert recs[0]["error"].startswith("malformed tool call JSON") and recs[0]["invalid"] and not recs[0]["ok"]
    assert tool_call_records("<tool_call>{\"name\": \"now\"}</tool_call>", None) == [
        record("now", {}, "unknown tool 'now'")]
    assert tool_call_records("no calls here", TOOLS) == []


def test_a_tool_schema_the_check_cannot_read_is_not_the_models_fault():
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x"]}}}]
    assert tool_call_records("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>", odd) == [
        record("f", {"x": 1})]


# ---- same_assistant ----------------------------------------------------------------------------------------

def test_same_assistant_compares_text_and_decoded_calls_not_ids_or_whitespace():
    returned = {"content": "hi", "tool_calls": [call("calc", "{\"expr\": \"1\", \"digits\": 2}", "id-1")]}
    sent = {"content": " hi\n", "tool_calls": [call("calc", {"digits": 2, "expr": "1"}, "other-id")]}
    assert same_assistant(sent, returned)
    assert same_assistant({"content": None}, {"content": "", "tool_calls": None})
    assert same_assistant({"content": "x", "tool_calls": [call("g", "raw")]},
                          {"content": "x", "tool_calls": [call("g", "raw")]})
    assert same_assistant({"content": "x", "tool_calls": [call("g", "")]},
                          {"content": "x", "tool_calls": [{"function": {"name": "g"}}]})
    assert not same_assistant({"content": "hi!", "tool_calls": sent["tool_calls"]}, returned)
    assert not same_assistant({"content": "hi", "tool_calls": [call("calc", {"expr": "2", "digits": 2})]}, returned)
    assert not same_assistant({"content": "hi", "tool_calls": [call("calx", {"expr": "1", "digits": 2})]}, returned)
    assert not same_assistant({"content": "hi"}, returned)
    assert not same_assistant({"content": "x", "tool_calls": [call("g", "raw")]},
                              {"content": "x", "tool_calls": [call("g", "raw2")]})
