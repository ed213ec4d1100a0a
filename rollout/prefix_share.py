"""Shared prompt prefixes: sequences that start with the same prompt blocks compute their keys/values once.

The G samples of a GRPO group, the `n` choices of a server request and the carried sequences of partial rollouts
start with the same prompt. Under the block-causal mask the keys/values of a prompt's whole blocks depend only on
those tokens (and the weights), so the first sequence computes them in its first forward and every other sequence
with the same whole prompt blocks copies them from its cache row (`BlockKVCache.copy_prefix`) instead of running
them. A sequence admitted in the same step as its source waits one step for the source's first forward; waiting
draws nothing from its generator, so its tokens are the ones it decodes alone (a row's draws happen only when it
takes part in a forward). The block that holds the prompt's end is decoded by every sequence itself.
"""
from __future__ import annotations

from .sequence import FINISHED


def shared_len(s, K: int) -> int:
    """Tokens of `s`'s prompt in whole blocks: the part another sequence's cache row can give it."""
    return (s.prompt_len // K) * K


def find_source(s, active: list, K: int):
    """A live sequence of `active` (other than `s`, not itself waiting for a source, not held between its client's
    calls) whose prompt starts with `s`'s whole prompt blocks, or None."""
    n = shared_len(s, K)
    if n == 0:
        return None
    head = s.prompt[:n]
    for o in active:
        if o is not s and o.prefix_source is None and o.slot is not None and not o.held and o.prompt_len >= n \
                and o.prompt[:n] == head:
            return o
    return None


def claim(s, active: list, cache, K: int) -> None:
    """At admission of `s` (its cache row empty): copy its prompt blocks from a live source that has them, or
    wait for one that is about to compute them (`s.prefix_source`)."""
    src = find_source(s, active, K)
    if src is None:
        return
    s.prefix_source = src
    settle(s, cache, K)


def settle(s, cache, K: int) -> bool:
    """Resolve a waiting `s`: copy when its source's row holds the prompt blocks; give up (compute them itself)
    when the source left, or is held (`Sequence.held`) without them. Returns True while `s` still waits."""
    src = s.prefix_source
    if src is None:
        return False
    n = shared_len(s, K)
    if src.status == FINISHED or src.slot is None:
        s.prefix_source = None
        return False
    if cache.lengths[src.slot] >= n:
        cache.copy_prefix(src.slot, s.slot, n)
        s.prefix_source = None
        return False
    if src.held:  # held between its client's calls: it computes nothing until taken back
        s.prefix_source = None
        return False
    return True


def prompt_tokens_in(s, q_start: int, q_end: int) -> int:
    """Prompt positions among the query slice [q_start, q_end) of one forward of `s` (what sharing saves)."""
    return max(0, min(q_end, s.prompt_len) - q_start)
