"""Multi-turn sequences laid out for block diffusion: every model turn ends on a block boundary.

A multi-turn trajectory is a time-ordered list of *segments*: the prompt, then model turn 1, the
environment's answer 1, model turn 2, ... Each token carries

* `generated`: True where the model wrote the token (scored by the likelihood, the SFT loss), False for
  prompt and environment context;
* `segment`: the index of its segment in time (0 = prompt, 1 = first model turn, 2 = first answer, ...).

Why align (docs/ebpo.md, "Multi-turn"): tokens of one block attend each other. A block holding the end
of model turn t *and* the environment's answer would let turn t's tokens see what came after them in
time. `layout_segments` therefore pads every model turn with `filler` (the EOS the decoder writes after a
finished turn) up to the next multiple of the block size, so the next segment starts a new block. The
filler belongs to the model turn (the decoder wrote that block whole), so it is `generated`. Context that
*precedes* a model turn may share the turn's first block: the turn was decoded with it visible, exactly
like a prompt's last partial block.

Pure Python / torch: no model, no tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The chat-template function-calling convention (Hermes / Qwen style): the model writes a call as
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the environment's answer comes back wrapped in
# `<tool_response>...</tool_response>` inside a user turn, followed by the next assistant header.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
OBSERVATION_TEMPLATE = "<|user|><tool_response>{observation}</tool_response><|role_end|><|assistant|>"


def round_up(n: int, block_size: int) -> int:
    """Smallest multiple of `block_size` that is >= n."""
    return -(-n // block_size) * block_size


@dataclass
class TurnLayout:
    """A laid-out multi-turn sequence. ids, generated, segment: one entry per token (same length L)."""

    ids: list[int]
    generated: list[bool]
    segment: list[int]
    filler: list[bool] = field(default_factory=list)  # True on the padding tokens added by the layout

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (L,) long, generated (L,) bool, segment (L,) long)."""
        return (torch.tensor(self.ids, dtype=torch.long), torch.tensor(self.generated, dtype=torch.bool),
                torch.tensor(self.segment, dtype=torch.long))


def layout_segments(segments: list[tuple[list[int], bool]], block_size: int, filler_id: int,
                    pad_last: bool = True) -> TurnLayout:
    """Concatenate time-ordered `(ids, generated)` segments, padding each generated segment with
    `filler_id` to a block boundary when another segment follows it (or always, with `pad_last`).

    A generated segment that already ends on a boundary gets no filler. Returns a `TurnLayout`.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    out = TurnLayout([], [], [], [])
    for s, (ids, gen) in enumerate(segments):
        out.ids += list(ids)
        out.generated += [bool(gen)] * len(ids)
        out.segment += [s] * len(ids)
        out.filler += [False] * len(ids)
        if gen and (pad_last or s + 1 < len(segments)):
            n = round_up(len(out.ids), block_size) - len(out.ids)
            out.ids += [filler_id] * n
            out.generated += [True] * n
            out.segment += [s] * n
            out.filler += [True] * n
    return out


def leaking_blocks(generated: torch.Tensor, segment: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, nb) bool: blocks in which a generated token shares its block with a token of a later segment.

    generated (B, L) bool, segment (B, L) long, non-decreasing along L. Right padding should carry
    segment -1 (it is nobody's future: the model never decoded it). Such a block would let the model's
    tokens attend the future: `ebpo.core.likelihood.turn_response_mask` refuses it.
    """
    B, L = generated.shape
    K = block_size
    nb = -(-L // K)
    pad = nb * K - L
    gen = torch.nn.functional.pad(generated.bool(), (0, pad), value=False).view(B, nb, K)
    seg = torch.nn.functional.pad(segment.long(), (0, pad), value=-1).view(B, nb, K)
    # the earliest generated segment of the block: a later segment anywhere in the block is its future, context
    # or model tokens alike ([turn t ; answer t ; turn t+1] in one block leaks the answer into turn t)
    first_gen_seg = torch.where(gen, seg, torch.full_like(seg, torch.iinfo(torch.long).max)).amin(-1)
    # the latest segment present in the block (padding, -1, never counts)
    latest = seg.amax(-1)
    has_gen = gen.any(-1)
    return has_gen & (latest > first_gen_seg)


def turn_index(generated: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """(B, L) long: the model turn (0, 1, ...) of each generated token, -1 for context tokens.

    Turns are numbered by the order of the generated segments within each row."""
    gen = generated.bool()
    start = gen & torch.cat([torch.ones_like(gen[:, :1]), segment[:, 1:] != segment[:, :-1]], 1)
    idx = start.long().cumsum(1) - 1
    return torch.where(gen, idx, torch.full_like(idx, -1))
