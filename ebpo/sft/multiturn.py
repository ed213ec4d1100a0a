"""Multi-turn SFT data: chat messages with tool calls -> token ids and a loss mask on assistant tokens.

Row format (`data.messages_field`, default "messages"): a list of `{"role", "content"}` with roles
system / user / assistant / tool, in the chat function-calling convention (an assistant turn that calls a
tool holds `<tool_call>{...}</tool_call>`; the tool's answer is a `tool` message). The layout is the one
multi-turn rollouts produce (`ebpo.core.turns`), so SFT and RL score the same sequences:

* the messages before the first assistant turn go through the chat template with the generation prompt
  (what `encode_prompt` gives for a single question);
* an assistant turn is its content followed by EOS (the token that ends a turn in decoding), padded with
  EOS to the next block boundary: loss on all of it (`generated`);
* a tool message is `OBSERVATION_TEMPLATE.format(observation=content)` (its answer wrapped in a tool turn
  and the next assistant header): context, no loss; a user message after the first is
  `<|user|>content<|role_end|><|assistant|>` rendered by the chat template, context too.

Tokens within a block attend each other, and no block holds a model turn together with what came after
it in time (docs/ebpo.md, "Multi-turn"), so the ordinary SFT objective on this mask sees no leaked future.
"""
from __future__ import annotations

from ebpo.core.turns import OBSERVATION_TEMPLATE, layout_segments


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_messages(tokenizer, messages: list[dict], block_size: int, *, max_len: int = 512,
                    observation_template: str = OBSERVATION_TEMPLATE, tools: list[dict] | None = None,
                    ) -> tuple[list[int], list[bool]]:
    """(ids, loss mask) of one conversation; loss on the assistant turns (and their EOS padding) only.

    Cut at `max_len` tokens (a conversation cut inside a turn keeps the tokens before the cut)."""
    if not messages or not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("a multi-turn SFT row needs at least one assistant message")
    eos = tokenizer.eos_token_id
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = tokenizer.apply_chat_template(messages[:first], tools=tools, add_generation_prompt=True, tokenize=False)
    segments: list[tuple[list[int], bool]] = [(_ids(tokenizer, head), False)]
    for m in messages[first:]:
        role, content = m["role"], str(m.get("content", ""))
        if role == "assistant":
            segments.append((_ids(tokenizer, content) + [eos], True))
        elif role == "tool":
            segments.append((_ids(tokenizer, observation_template.format(observation=content)), False))
        else:
            text = tokenizer.apply_chat_template([m], add_generation_prompt=True, tokenize=False)
            segments.append((_ids(tokenizer, text), False))
    lay = layout_segments(segments, block_size, filler_id=eos, pad_last=True)
    return lay.ids[:max_len], lay.generated[:max_len]
