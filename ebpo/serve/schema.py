"""Chat-completion requests: validation of the OpenAI request body into a `ChatRequest`, and the error shape.

Supported fields: model, messages, tools, tool_choice ("auto" / "none"), n, seed, temperature, top_p,
max_tokens (or max_completion_tokens), stop, stream (server-sent events)
with stream_options.include_usage. Draft-and-edit settings ride in the request's extra body (`extra_body=` of
the `openai` client): mode (a `DecodeConfig` preset:
quality | speed | m2t), tau_mask, tau_edit, tau_delete, tau_insert (DELETE / INSERT: a threshold turns it on,
null turns it off), mbe_window, top_k, and return_token_ids (each choice then carries its `token_ids`).
Anything else that the OpenAI API defines but this server does not implement is refused, naming the field,
rather than silently ignored; a few fields that cannot change the result (user, metadata, store, ...) pass.

Every refusal is a `RequestError`, answered as OpenAI answers: HTTP 4xx with
`{"error": {"message", "type", "param", "code"}}`.

`decode_body(raw)` turns the raw body into JSON before any field is read, and refuses what no field check
would see: invalid JSON or UTF-8, nesting deeper than `MAX_JSON_DEPTH` (a body nested 10^4 levels makes the
JSON decoder itself recurse; one nested a few hundred levels would make the chat template's JSON writer
recurse later), and lone UTF-16 surrogates (`"\\ud800"` is valid JSON but no valid text: the tokenizer
cannot encode it). Its work is linear in the body's length; the app runs it off the event loop.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rollout.config import PRESETS, DecodeConfig

ROLES = ("system", "user", "assistant", "tool")
DRAFT_EDIT_FIELDS = ("tau_mask", "tau_edit", "tau_delete", "tau_insert", "mbe_window", "top_k")
IGNORED_FIELDS = ("user", "metadata", "store", "parallel_tool_calls", "service_tier")
NEUTRAL_DEFAULTS = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False}
MAX_N = 16
MAX_STOP = 4
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: 32 bytes of JSON per token of a 128K-token context
DEFAULT_SHUTDOWN_GRACE_S = 10.0  # on SIGTERM, the seconds requests in flight get to finish
MAX_JSON_DEPTH = 32  # objects and arrays inside each other; a real request nests < 12 (tool schemas included)
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `type`, the offending `param`, a `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers  # extra response headers (Retry-After of a 429)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def decode_body(raw: bytes):
    """The JSON value of a request body (module docstring); RequestError (400) when it is not UTF-8 JSON,
    nests deeper than MAX_JSON_DEPTH or holds a lone surrogate, naming the top-level field where it can."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not UTF-8: {e}", None, "invalid_json") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise RequestError(f"the request nests deeper than {MAX_JSON_DEPTH} levels", None, "too_deep") from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    check_json(value)
    return value


def check_json(value) -> None:
    """RequestError when `value` (decoded JSON) nests deeper than MAX_JSON_DEPTH or holds a string (or key)
    with a lone surrogate. Iterative: no recursion however deep the value."""
    stack = [(value, 1, None)]
    while stack:
        v, depth, top = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise RequestError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid text",
                                   top, "invalid_text")
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request nests deeper than {MAX_JSON_DEPTH} levels", top, "too_deep")
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            here = top if top is not None else (k if isinstance(k, str) else None)
            if isinstance(k, str) and _SURROGATE.search(k):
                raise RequestError("a key holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid text",
                                   top, "invalid_text")
            stack.append((x, depth + 1, here))


@dataclass
class ChatRequest:
    """A validated request. messages: [{"role", "content" (str), "tool_calls"?, "tool_call_id"?}];
    config: the request's `DecodeConfig` (max_new_tokens = max_tokens); seed: None = fresh seeds."""

    model: str
    messages: list[dict]
    config: DecodeConfig
    tools: list[dict] | None = None
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    return_token_ids: bool = False
    tool_choice: str = "auto"
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _content(value, where: str) -> str:
    """A message's content as text: a string, null, or a list of {"type": "text", "text"} parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _tool_calls(value, where: str) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", ""), (str, dict))):
            raise RequestError(f"{where}.tool_calls[{j}] needs function.name and function.arguments",
                               f"{where}.tool_calls")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def parse_messages(value) -> list[dict]:
    """Validated messages (module docstring); RequestError naming the first bad one."""
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}", f"{where}.role")
        msg = {"role": role, "content": _content(m.get("content"), where)}
        if role == "assistant":
            msg["tool_calls"] = _tool_calls(m.get("tool_calls"), where)
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def parse_tools(value) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError("tools must be a list", "tools")
    for j, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str)):
            raise RequestError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        if not isinstance(fn.get("parameters", {}), dict):  # a JSON Schema object, as OpenAI requires
            raise RequestError(f"tools[{j}].function.parameters must be a JSON Schema object", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise RequestError(f"tools[{j}].function.description must be a string", "tools")
    return list(value) or None


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops) and len(stops) <= MAX_STOP):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return list(stops)


def _decode_config(body: dict, default: DecodeConfig, max_tokens_limit: int) -> DecodeConfig:
    mode = body.get("mode")
    if mode is not None and mode not in PRESETS:
        raise RequestError(f"mode must be one of {sorted(PRESETS)}, got {mode!r}", "mode")
    over: dict = {}
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None:
        if not (_is_int(max_tokens) and 1 <= max_tokens <= max_tokens_limit):
            raise RequestError(f"max_tokens must be an integer in [1, {max_tokens_limit}]", "max_tokens")
        over["max_new_tokens"] = max_tokens
    if body.get("temperature") is not None:
        t = body["temperature"]
        if not (_is_num(t) and 0 <= t <= 2):
            raise RequestError("temperature must be a number in [0, 2]", "temperature")
        over["temperature"] = float(t)
    if body.get("top_p") is not None:
        over["top_p"] = body["top_p"]
    for name in DRAFT_EDIT_FIELDS:
        if name in body:
            over[name] = body[name]
    try:
        base = default if mode is None else DecodeConfig.preset(
            mode, **{k: getattr(default, k) for k in ("max_new_tokens", "temperature")})
        cfg = base.replace(**over)
    except (ValueError, TypeError) as e:
        param = next((k for k in over if f"DecodeConfig.{k}" in str(e)), None)
        raise RequestError(str(e), param) from None
    return cfg


def parse_request(body, default: DecodeConfig, max_tokens_limit: int) -> ChatRequest:
    """Validate a chat-completion request body against the server's `default` config. RequestError on a
    bad or unsupported field (module docstring)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    known = {"model", "messages", "tools", "tool_choice", "n", "seed", "temperature", "top_p", "max_tokens",
             "max_completion_tokens", "stop", "stream", "stream_options", "mode", "return_token_ids", *DRAFT_EDIT_FIELDS,
             *IGNORED_FIELDS}
    for key, value in body.items():
        if key in NEUTRAL_DEFAULTS and value in (None, NEUTRAL_DEFAULTS[key]):
            continue
        if key not in known:
            raise RequestError(f"{key} is not supported by this server", key, "unsupported_parameter")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not (isinstance(options, dict) and set(options) <= {"include_usage"}
            and isinstance(options.get("include_usage", False), bool)):
        raise RequestError("stream_options may only hold include_usage (true or false)", "stream_options")
    if options and not stream:
        raise RequestError("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(body.get("model"), str):
        raise RequestError("model must be a string", "model")
    n = body.get("n", 1) if body.get("n") is not None else 1
    if not (_is_int(n) and 1 <= n <= MAX_N):
        raise RequestError(f"n must be an integer in [1, {MAX_N}]", "n")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2 ** 63):
        raise RequestError("seed must be an integer in [0, 2**63)", "seed")
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise RequestError("tool_choice: only 'auto' and 'none' are supported", "tool_choice", "unsupported_value")
    rti = body.get("return_token_ids", False)
    if not isinstance(rti, bool):
        raise RequestError("return_token_ids must be true or false", "return_token_ids")
    return ChatRequest(model=body["model"], messages=parse_messages(body.get("messages")),
                       config=_decode_config(body, default, max_tokens_limit), tools=parse_tools(body.get("tools")),
                       n=n, seed=seed, stop=_stop(body.get("stop")), return_token_ids=rti, tool_choice=choice,
                       stream=stream, include_usage=bool(options.get("include_usage", False)))
