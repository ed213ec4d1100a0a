"""Chat messages <-> token ids, in the layout the models were trained on, and model text -> an assistant message.

A conversation is laid out as multi-turn SFT data and multi-turn rollouts lay it out (`ebpo.sft.multiturn`,
`rollout.multiturn`): the messages before the first assistant turn go through the tokenizer's chat template
(with `tools=`) and its generation prompt; an earlier assistant turn is its text (tool calls written back in
the `<tool_call>{...}</tool_call>` form) and EOS, padded with EOS to a block boundary; consecutive tool messages
are one observation, their contents joined by newlines and wrapped in the observation template (the tool turn
and the next assistant header, as `rewards.envs.ToolEnv` answers a turn); a later user or system message goes
through the chat template alone, with the generation prompt.

The model's text comes back as an OpenAI assistant message: the `<tool_call>` blocks are parsed with the
linear parser of `rewards.envs.tools` and returned as `tool_calls` (finish_reason "tool_calls"), the rest of
the text as `content`. A malformed call stays in the content: the caller sees what the model wrote.
`tool_call_records` gives the same calls as an environment records them (the agent gateway's turns).
"""
from __future__ import annotations

import json

from ebpo.core.turns import OBSERVATION_TEMPLATE, layout_segments
from rewards.envs.tools import parse_tool_calls, tool_call_bodies, validate_arguments


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def call_text(tool_calls: list[dict]) -> str:
    """Assistant tool calls written back as the model writes them: `<tool_call>{"name", "arguments"}</tool_call>`."""
    parts = []
    for c in tool_calls:
        args = c["function"].get("arguments", "")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as the string the caller sent
        parts.append("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": args}) + "</tool_call>")
    return "".join(parts)


def assistant_text(message: dict) -> str:
    """The text the model would have written for an assistant message (content, then its tool calls)."""
    calls = call_text(message.get("tool_calls") or [])
    content = message.get("content") or ""
    return content + calls if not calls or not content else content + "\n" + calls


def extension_ids(tokenizer, messages: list[dict], observation_template: str = OBSERVATION_TEMPLATE) -> list[int]:
    """Token ids of messages that follow an assistant turn (tool results, a new user message), ending with the
    next assistant header; ValueError if they hold an assistant message or do not end with user / tool."""
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise ValueError("the messages after an assistant turn must end with a user or tool message")
    out: list[int] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "assistant":
            raise ValueError("extension_ids: an assistant message is not an extension")
        if m["role"] == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            obs = "\n".join(x["content"] for x in messages[i:j])
            out += _ids(tokenizer, observation_template.format(observation=obs))
            i = j
            continue
        out += _ids(tokenizer, tokenizer.apply_chat_template([m], add_generation_prompt=True, tokenize=False))
        i += 1
    return out


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None, block_size: int, eos_id: int,
               observation_template: str = OBSERVATION_TEMPLATE) -> list[int]:
    """Token ids of a whole conversation up to the next assistant turn (module docstring); ValueError when the
    last message is an assistant message (nothing to answer)."""
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message is an assistant message: there is nothing to answer")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    if first == len(messages):
        head = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return _ids(tokenizer, head)
    head = tokenizer.apply_chat_template(messages[:first], tools=tools, add_generation_prompt=True, tokenize=False)
    segments: list[tuple[list[int], bool]] = [(_ids(tokenizer, head), False)]
    rest = messages[first:]
    i = 0
    while i < len(rest):
        if rest[i]["role"] == "assistant":
            segments.append((_ids(tokenizer, assistant_text(rest[i])) + [eos_id], True))
            i += 1
            continue
        j = i
        while j < len(rest) and rest[j]["role"] != "assistant":
            j += 1
        segments.append((extension_ids(tokenizer, rest[i:j], observation_template), False))
        i = j
    return layout_segments(segments, block_size, filler_id=eos_id, pad_last=False).ids


def assistant_message(text: str, call_ids: list[str]) -> tuple[dict, bool]:
    """(OpenAI assistant message, whether it holds tool calls) of the model's `text`; `call_ids`: an id per
    call, taken in order (enough for every call the text can hold)."""
    calls = parse_tool_calls(text)
    if not calls or any("error" in c for c in calls):
        return {"role": "assistant", "content": text, "tool_calls": None}, False
    content = text
    for body in tool_call_bodies(text):
        content = content.replace("<tool_call>" + body + "</tool_call>", "", 1)
    tool_calls = [{"id": call_ids[k], "type": "function",
                   "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                  for k, c in enumerate(calls)]
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": tool_calls}, True


def tool_call_records(text: str, tools: list[dict] | None) -> list[dict]:
    """One record per `<tool_call>` in a model turn's `text`, in the shape of an environment's
    `info["tool_calls"]` (`rewards.envs.tools`: name, arguments, ok, error, invalid, timeout, latency_s, result):
    `ok` when the call is well-formed JSON, names one of `tools` (the request's OpenAI tool specs) and its
    arguments fit that tool's parameters; otherwise `error` says why. The gateway never runs a tool, so `result`
    is None and a tool that fails when the harness runs it is not an error here."""
    specs = {t["function"]["name"]: t for t in tools or []}
    out = []
    for call in parse_tool_calls(text):
        why = call.get("error")
        if why is None and call["name"] not in specs:
            why = f"unknown tool {call['name']!r}"
        if why is None:
            try:
                why = validate_arguments(specs[call["name"]], call["arguments"])
            except (AttributeError, TypeError, KeyError):  # a schema the check cannot read: not the model's fault
                why = None
        out.append({"name": call.get("name"), "arguments": call.get("arguments"), "ok": why is None, "error": why,
                    "invalid": why is not None, "timeout": False, "latency_s": 0.0, "result": None})
    return out


def same_assistant(sent: dict, returned: dict) -> bool:
    """Whether an assistant message in a request is the one the server returned: same text content (None and
    "" alike, outer whitespace ignored) and the same calls (names and decoded arguments; ids ignored)."""
    def calls(m):
        out = []
        for c in m.get("tool_calls") or []:
            args = c["function"].get("arguments", "")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass
            out.append((c["function"]["name"], json.dumps(args, sort_keys=True)))
        return out

    return (sent.get("content") or "").strip() == (returned.get("content") or "").strip() and calls(sent) == calls(returned)
