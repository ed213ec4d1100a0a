"""A stub block-diffusion LM, tokenizer and environment for fast engine tests (rollout/multiturn.py, partial.py,
env_steps.py, static_slots.py, engine.py), and plain-Python references of the rules they implement.

The stub model has the call signature of `LLaDA2MoeModelLM` as the engine uses it (eager rows with or without a
`BlockKVCache`, the compiled step's `StaticKVCache`) and two layers of a toy attention, so that a cache holding
wrong or missing keys changes what later positions see. Layer 1's key at position i is k1 = (token + 1) * (i + 1) +
2^30 (exact in fp64 only); layer 2's key is the sum of the layer-1 keys the position attends (through the mask it is
given, from the cache and the input); the output at position p reads the keys of the *strictly earlier blocks* it
attends, ctx = sum of (k1 + k2) there. The candidate at p is `rule(p, ctx, version)` with logit `margin` over the
others (10 by default: p > 0.99), so with any preset every mask of a block is filled on the block's first forward,
and (editing on) the confirming post-step sees the same candidates and ends the block: the decode of a block is the
rule applied to the blocks before it (`ctx_of`). A small margin makes sampling meaningful.
"""
from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import torch
from torch import nn

from ebpo.core.turns import round_up
from ebpo.model.cache import BlockKVCache, StaticKVCache
from rollout.multiturn import MultiTurnConfig, TurnDriver
from rollout.sequence import WAITING

K = 4
V = 48
MASK, EOS = 47, 46
CLOSE = 32  # decodes to "</tool_call>"
MARGIN = 10.0  # logit of the candidate over the others: p = e^10 / (e^10 + 47) > 0.99
OFFSET = 2 ** 30  # added to every layer-1 key: exact in fp64, not in fp32 (a cache of the wrong dtype shows)


DEL, INS = 44, 45  # edit-control tokens (Levenshtein editing), never written


class Rule:
    """rule(p, ctx, version) -> token: a hash of its arguments; EOS when the hash is below `eos`, the closing
    tool-call token below `eos + tool`, DELETE / INSERT in the next `dele` / `ins` values, else a word 0..31."""

    def __init__(self, a=5, b=3, c=1, eos=0, tool=0, mod=97, dele=0, ins=0, edit=False):
        self.a, self.b, self.c, self.eos, self.tool, self.mod = a, b, c, eos, tool, mod
        self.dele, self.ins, self.edit = dele, ins, edit

    def __call__(self, p: int, ctx: int, version: int = 0, cur: int = MASK) -> int:
        """cur: the token now at p; with `edit`, some written words are predicted as the next word (T2T)."""
        if self.edit and cur < 32 and (cur + p) % 5 == 0:
            return (cur + 1) % 32
        h = (self.a * p + self.b * ctx + self.c + 7 * version) % self.mod
        for cut, tok in ((self.eos, EOS), (self.tool, CLOSE), (self.dele, DEL), (self.ins, INS)):
            if h < cut:
                return tok
            h -= cut
        return h % 32


def ctx_of(canvas: list[int], block: int) -> int:
    """The context the stub reads for a query in `block` (module docstring), from the final tokens."""
    k1 = [(t + 1) * (i + 1) + OFFSET for i, t in enumerate(canvas[:block * K])]
    k2 = [sum(k1[:(j // K + 1) * K]) for j in range(block * K)]
    return sum(k1) + sum(k2)


class _Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self._model = [model]  # not a submodule: no parameter twice

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        flat = h.reshape(-1, h.shape[-1]).double()
        out = torch.zeros(flat.shape[0], V, dtype=torch.float64, device=h.device)
        for i, (p, cur, ctx) in enumerate(flat.tolist()):
            out[i, model.rule(int(p), int(ctx), model.version, int(cur))] = model.margin
        return out.reshape(*h.shape[:-1], V)


class StubLM(nn.Module):
    """See the module docstring. `version` stands for the weights (the rule reads it); `calls` counts forwards."""

    def __init__(self, rule: Rule | None = None, eos=EOS, margin=MARGIN, lev=False):
        super().__init__()
        self.rule, self.margin = rule or Rule(), margin
        self.version = 0
        self.calls = 0
        self.log: list = []  # (cache kind, rows, length) of every forward
        self.weight = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.config = SimpleNamespace(block_size=K, mask_token_id=MASK, eos_token_id=eos, vocab_size=V,
                                      num_hidden_layers=2, num_key_value_heads=1, head_dim=1)
        if lev:
            self.config.delete_token_id, self.config.insert_token_id = DEL, INS
        self.lm_head = _Head(self)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, cache_rows=None,
                return_logits=True, token_mask=None, **_):
        self.calls += 1
        self.log.append((type(cache).__name__, *input_ids.shape))
        B, L = input_ids.shape
        dev = input_ids.device  # every tensor on the inputs' device, as a real model keeps them
        pos = position_ids.expand(B, L) if position_ids is not None else torch.arange(L, device=dev)[None].expand(B, L)
        k1 = ((input_ids.double() + 1) * (pos.double() + 1) + OFFSET)[..., None, None]  # (B, L, 1, 1)

        def attend(keys, keep):  # (B, S', 1, 1), (B|1, 1, L, S') -> (B, L)
            return (keys[:, None, :, 0, 0] * keep[:, 0]).sum(-1)

        if isinstance(cache, StaticKVCache):
            keys1, _ = cache.write(0, k1, k1)
            keep = attention_mask
            k2 = attend(keys1, keep)[..., None, None]
            keys2, _ = cache.write(1, k2, k2)
            kpos = torch.arange(keys1.shape[1], device=dev)[None].expand(B, -1)  # the buffer slot is the position
            kpos = torch.where(kpos < keys1.shape[1] - K, kpos, 10 ** 9)  # the spare tail: never an earlier block
        elif isinstance(cache, BlockKVCache):
            view = cache.begin(cache_rows)
            S = view.prefix_len
            keep = attention_mask
            if keep is None or keep.shape[-1] != S + L:
                new = keep if keep is not None else torch.ones(1, 1, L, L, dtype=torch.bool, device=dev)
                keep = torch.cat([view.valid[:, None, None, :].expand(B, 1, L, S), new.expand(B, 1, L, L)], -1)
            cache.stage(0, k1, k1)
            keys1 = torch.cat([cache.prefix(0)[0].to(k1.dtype), k1], 1)
            k2 = attend(keys1, keep)[..., None, None]
            cache.stage(1, k2, k2)
            keys2 = torch.cat([cache.prefix(1)[0].to(k2.dtype), k2], 1)
            kpos = torch.cat([torch.arange(S, device=dev)[None].expand(B, S), pos], 1)
        else:
            keep = attention_mask if attention_mask is not None else torch.ones(1, 1, L, L, dtype=torch.bool,
                                                                                    device=dev)
            keys1, k2 = k1, attend(k1, keep)[..., None, None]
            keys2, kpos = k2, pos
        earlier = (kpos[:, None, :] // K) < (pos[:, :, None] // K)  # (B, L, S')
        use = keep[:, 0].expand(B, L, -1) & earlier
        ctx = ((keys1 + keys2)[:, None, :, 0, 0] * use).sum(-1)
        h = torch.stack([pos.double(), input_ids.double(), ctx], -1)
        return SimpleNamespace(last_hidden_state=h, logits=self.lm_head(h).float() if return_logits else None)


WORDS = {i: f"w{i}" for i in range(32)}
WORDS[CLOSE] = "</tool_call>"
PIECE = re.compile(r"<[^>]*>|[^<\s]+")


class StubTokenizer:
    """Words w0..w31 and "</tool_call>" decode from their ids (EOS and MASK are special). Encoding splits text
    into markers `<...>` and words; each piece gets an id in 33..45 from its bytes (a fixed function)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(WORDS.get(int(t), f"<{int(t)}>") for t in ids
                        if not (skip_special_tokens and int(t) in (EOS, MASK)))

    def __call__(self, text, add_special_tokens=True):
        """As a Hugging Face tokenizer, special tokens (here a leading 33) are added unless told not to; the flag
        must be a bool (the fast tokenizers raise TypeError for None)."""
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"{add_special_tokens!r} is not an instance of 'bool'")
        ids = [33 + sum(piece.encode()) % 13 for piece in PIECE.findall(text)]
        return {"input_ids": ([33] if add_special_tokens else []) + ids}


class ScriptEnv:
    """Answers step k (1-based) with `obs[k - 1]` (cycled) words "o"; done after `n` steps; `latency` seconds
    per step (a number, or a dict step -> seconds); `fail_at`: that step raises; `bad_at`: returns garbage."""

    def __init__(self, n=3, obs=(1,), latency=0.0, fail_at=None, bad_at=None, reward=1.0, info=None):
        self.n, self.obs, self.latency, self.fail_at, self.bad_at = n, obs, latency, fail_at, bad_at
        self.reward, self.info = reward, info
        self.texts: list[str] = []
        self.started: list[float] = []
        self.closed = 0
        self.lock = threading.Lock()

    def reset(self, row, seed=None):
        self.row, self.seed = row, seed
        return row.get("first") if isinstance(row, dict) else None

    def step(self, text):
        with self.lock:
            self.texts.append(text)
            self.started.append(time.monotonic())
            k = len(self.texts)
        lat = self.latency.get(k, 0.0) if isinstance(self.latency, dict) else self.latency
        if lat:
            time.sleep(lat)
        if k == self.fail_at:
            raise RuntimeError("tool broke")
        if k == self.bad_at:
            return ("not", "a", "step")
        words = self.obs[(k - 1) % len(self.obs)]
        info = dict(self.info) if self.info else {}
        return (" ".join(["o"] * words), self.reward * k, k >= self.n, info)

    def close(self):
        self.closed += 1


def env_answer(env: ScriptEnv, k: int):
    """What `env.step` answers at step k (1-based) without calling it: (observation, reward, done)."""
    words = env.obs[(k - 1) % len(env.obs)]
    return " ".join(["o"] * words), env.reward * k, k >= env.n


def reference_multiturn(prompt, env, rule, mt, T, tok=None, version=0):
    """The documented multi-turn rollout of one prompt, as a plain loop (docs/rl.md, rollout/multiturn.py):
    turns of whole blocks, ending at a block holding EOS, a closed </tool_call> (when stop_at_tool_call) or the
    turn's last budget block; the observation appended right after the turn's last block; limits max_turns,
    max_turn_tokens, max_total_tokens (and the canvas T). `env`: a ScriptEnv (only its script is read).
    Returns dict(ids, generated, segment, turns=[(start, end, finished_by, text)], stop, texts)."""
    tok = tok or StubTokenizer()
    budget = min(T, mt.max_total_tokens)
    canvas = list(prompt) + [MASK] * (T - len(prompt))
    generated, segment = [False] * T, [0] * len(prompt) + [-1] * (T - len(prompt))
    start = length = len(prompt)
    turns, texts = [], []
    if start >= budget:
        return dict(ids=canvas[:length], generated=generated[:length], segment=segment[:length], turns=turns,
                    stop="max_total_tokens", texts=texts)
    while True:
        last = min(round_up(start + mt.max_turn_tokens, K), round_up(budget, K), T) // K
        b = start // K
        while True:
            ctx = ctx_of(canvas, b)
            for p in range(max(start, b * K), (b + 1) * K):
                canvas[p] = rule(p, ctx, version)
            toks = canvas[start:(b + 1) * K]
            eos = EOS in toks
            text = tok.decode(toks[:toks.index(EOS)] if eos else toks)
            why = ("eos" if eos else "tool_call" if mt.stop_at_tool_call and "</tool_call>" in text
                   else "budget" if b + 1 >= last else None)
            if why:
                break
            b += 1
        end = (b + 1) * K
        for p in range(start, end):
            generated[p], segment[p] = True, 2 * len(turns) + 1
        turns.append((start, end, why, text))
        texts.append(text)
        length = end
        obs, _reward, done = env_answer(env, len(turns))
        stop = "done" if done else "max_turns" if len(turns) >= mt.max_turns else None
        if stop is None:
            ids = tok(mt.observation_template.format(observation=obs), add_special_tokens=False)["input_ids"]
            if length + len(ids) + 1 > budget:
                empty = len(tok(mt.observation_template.format(observation=""), add_special_tokens=False)["input_ids"])
                stop = "max_total_tokens" if length + empty + 1 > budget else "observation_overflow"
        if stop:
            return dict(ids=canvas[:length], generated=generated[:length], segment=segment[:length], turns=turns,
                        stop=stop, texts=texts)
        canvas[length:length + len(ids)] = ids
        for p in range(length, length + len(ids)):
            segment[p] = 2 * len(turns)
        start = length = length + len(ids)


def reference_single(prompt, rule, max_new, T=None, versions=None, stop_at_eos=True):
    """The single-turn decode of one prompt: blocks from the prompt's, each the rule over the blocks before
    (block b under versions[b], default 0), until the block holding the first EOS of the generated region or
    the last block of prompt + max_new. Returns (canvas up to the last decoded block's end, blocks decoded)."""
    P = len(prompt)
    nb = -(-(P + max_new) // K)
    canvas = list(prompt) + [MASK] * (nb * K - P)
    blocks = []
    for b in range(P // K, nb):
        ctx = ctx_of(canvas, b)
        v = (versions or {}).get(b, 0)
        for p in range(max(P, b * K), (b + 1) * K):
            canvas[p] = rule(p, ctx, v)
        blocks.append(b)
        if stop_at_eos and EOS in canvas[P:min(P + max_new, (b + 1) * K)]:
            break
    return canvas[:(blocks[-1] + 1) * K], blocks


def exported_at_a_boundary(model, cfg, waiting: bool, latency: float):
    """A first engine decodes one 10-token prompt, waiting on its environment after two turns (`waiting`, steps
    of `latency` s) or single-turn up to block 5, drains and exports it. Returns (the first engine's multi-turn
    client, a `TurnDriver`, the sequence, the MultiTurnConfig, the tokenizer), for a second engine to adopt it."""
    mt = MultiTurnConfig(max_turns=3, max_turn_tokens=7, max_total_tokens=80, stop_at_tool_call=False,
                         observation_template="<o>{observation}</o>")
    tok = StubTokenizer()
    first = TurnDriver(model, cfg, max_batch=1, canvas_len=80, tokenizer=tok, mt=mt)
    prompt = [(3 * j + 1) % 30 for j in range(10)]
    if waiting:
        s = first.submit(prompt, env=ScriptEnv(3, obs=(5,), latency=latency))
        first.run_until(lambda: s.status == WAITING and len(s.turns) == 2)
    else:
        s = first.engine.submit(prompt)  # single-turn: the engine's own
        first.run_until(lambda: s.block >= 5)
    first.drain()
    (out,) = first.engine.export()
    assert out is s
    return first, s, mt, tok
