"""A stub model for fast tests of the rollout engine, and a plain-Python reference decoder written from
docs/decoding.md for it (the fast tests of rollout/engine.py and rollout/decoder.py).

The stub has the call signature the engine uses (`model(input_ids, attention_mask=keep, position_ids=...,
cache=..., cache_rows=..., return_logits=False, token_mask=...)` -> `.last_hidden_state`, then `lm_head`), and
a prefix KV cache of its own kind: a key is (token id, position). The "hidden state" at a query position is
directly its logits: row `(ctx * 31 + position * 7) % M` of a fixed table, where ctx is the sum over the keys
that the query attends (cached prefix and new tokens, by the keep-mask) of an integer weight of (position,
token). So the logits depend on exactly what the position sees: a stale cached key, a wrong mask or a wrong
slice changes them. The reference computes ctx from the canvas by the documented visibility (a block sees
every position before its end; a Multi-Block Editing window is one enlarged block) and decodes in plain
Python lists.

Each table row is built from a designed distribution: a top token with probability p in P_GRID over the
ordinary tokens (the others share the rest), and, with `lev`, DELETE / INSERT masses from E_GRID, each plus
an offset distinct per row (< 0.021). Every threshold the tests use lies at least 0.03 from every grid value
and its offsets, far beyond fp32 rounding of a softmax; no two rows tie.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

MASK, EOS, V = 1, 2, 12
DEL_ID, INS_ID = 10, 11
P_GRID = (0.35, 0.6, 0.8, 0.96)
E_GRID = (0.0, 0.05, 0.45, 0.7)
M = 509
JITTER = 4e-5  # times a row's rank: offsets < 0.021, distinct rows differ by >= 2e-5


def key_weight_py(pos: int, tok: int) -> int:
    return ((tok + 1) * 7919 + (pos + 1) * 104729) % 65537


class StubModel(torch.nn.Module):
    """See the module docstring. eos_rate: share of table rows whose top token is EOS; lev: DELETE / INSERT
    priced (the config then names their ids)."""

    def __init__(self, K: int = 4, seed: int = 0, eos_rate: float = 0.04, lev: bool = False, p_grid=P_GRID):
        super().__init__()
        self.config = SimpleNamespace(block_size=K, mask_token_id=MASK, eos_token_id=EOS, vocab_size=V,
                                      num_hidden_layers=1, num_key_value_heads=1, head_dim=2)
        if lev:
            self.config.delete_token_id, self.config.insert_token_id = DEL_ID, INS_ID
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.lm_head = torch.nn.Identity()
        self.calls = 0
        g = torch.Generator().manual_seed(seed)
        ordinary = [t for t in range(V) if t not in (MASK, DEL_ID, INS_ID)]
        rows = []
        # a distinct offset per row (and per probability kind), so that no two rows tie in a ranking: ties
        # would be broken by fp32 rounding, not by the documented position order
        jit = torch.randperm(M, generator=g).tolist()
        for r in range(M):
            eos_top = float(torch.rand((), generator=g)) < eos_rate
            others = [t for t in ordinary if t != EOS]
            top = EOS if eos_top else others[int(torch.randint(len(others), (), generator=g))]
            p = p_grid[int(torch.randint(len(p_grid), (), generator=g))] + JITTER * jit[r]
            rest = [t for t in ordinary if t != top]
            u = 0.5 + 0.5 * torch.rand(len(rest), generator=g, dtype=torch.float64)
            q = {top: p, **{t: (1 - p) * float(x) / float(u.sum()) for t, x in zip(rest, u)}}
            d = i = 0.0
            if lev:
                d = E_GRID[int(torch.randint(len(E_GRID), (), generator=g))] + JITTER * jit[-1 - r]
                i = E_GRID[int(torch.randint(len(E_GRID), (), generator=g))] + JITTER * (jit[-1 - r] + 0.5)
                if d + i > 0.9:
                    i = JITTER * (jit[-1 - r] + 0.5)
            full = [0.0] * V
            for t, v in q.items():
                full[t] = v * (1 - d - i)
            full[DEL_ID], full[INS_ID], full[MASK] = d, i, 0.3
            rows.append([math.log(v) if v > 0 else float("-inf") for v in full])
        self.table = torch.tensor(rows, dtype=torch.float32)
        self.lev = lev
        self._ref_rows: dict[int, tuple] = {}

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, cache_rows=None,
                return_logits=True, token_mask=None, **kw):
        self.calls += 1
        keys = torch.stack([input_ids, position_ids], -1).float()[:, :, None, :]  # (b, L, 1, 2)
        if cache is not None:
            cache.begin(cache_rows, device=input_ids.device)
            cache.stage(0, keys, keys)
            prefix, _ = cache.prefix(0)
            keys = torch.cat([prefix.to(keys.dtype), keys], 1)
        tok, pos = keys[:, :, 0, 0].long(), keys[:, :, 0, 1].long()
        w = ((tok + 1) * 7919 + (pos + 1) * 104729) % 65537  # key_weight_py, batched
        keep = attention_mask[:, 0]
        if keep.shape[-1] != w.shape[-1] or keep.dtype != torch.bool:
            raise ValueError(f"stub: keep-mask {tuple(keep.shape)} {keep.dtype} for {w.shape[-1]} keys")
        ctx = (keep.long() * w[:, None, :]).sum(-1)
        h = self.table[(ctx * 31 + position_ids * 7) % M]
        return SimpleNamespace(last_hidden_state=h, logits=h if return_logits else None)

    # ---- the reference's side: plain Python
    def ref_row(self, r: int, lev: bool) -> tuple:
        """(candidate, its probability, p(DELETE), p(INSERT)) of table row r, in float64, as documented:
        [MASK] never a candidate; with Levenshtein editing on, DELETE / INSERT are priced then excluded."""
        key = (r, lev)
        if key not in self._ref_rows:
            row = self.table[r].double().clone()
            row[MASK] = float("-inf")
            d = i = 0.0
            if lev:
                full = torch.softmax(row, -1)
                d, i = float(full[DEL_ID]), float(full[INS_ID])
                row[[DEL_ID, INS_ID]] = float("-inf")
            p = torch.softmax(row, -1)
            c = int(torch.argmax(p))
            self._ref_rows[key] = (c, float(p[c]), d, i)
        return self._ref_rows[key]

    def ref_candidates(self, x: list[int], lo: int, hi: int, lev: bool) -> dict[int, tuple]:
        """Candidates of positions [lo, hi) that all see x[:hi] (one block, or one MBE window ending at hi)."""
        ctx = sum(key_weight_py(j, x[j]) for j in range(hi))
        return {i: self.ref_row((ctx * 31 + i * 7) % M, lev) for i in range(lo, hi)}


def cfg_flags(cfg):
    editing = cfg.tau_edit is not None and cfg.tau_edit >= 0
    on_d = cfg.tau_delete is not None and cfg.tau_delete >= 0
    on_i = cfg.tau_insert is not None and cfg.tau_insert >= 0
    return editing, on_d, on_i


class RefSeq:
    """The reference's state of one sequence: canvas x, trace, counters, logs, per-forward canvas snapshots."""

    def __init__(self, x: list[int], P: int):
        self.x, self.P = x, P
        self.trace = [-1] * len(x)
        self.forwards = self.edits = self.mbe_edits = self.deletes = self.inserts = 0
        self.edit_log: list[tuple[int, int, int]] = []
        self.lev_drafts: dict[int, list[int]] = {}
        self.snapshots: list[list[int]] = []
        self.events: list[tuple] = []  # (kind, block, block_done)


def ref_block(stub: StubModel, rs: RefSeq, b: int, start: int, cfg) -> None:
    """Decode block b of rs to its end (docs/decoding.md): M2T with the fallback, T2T, DELETE / INSERT, the
    block-end rule with post-steps, the forward cap and early commit. Positions < start are context."""
    K, x = stub.config.block_size, rs.x
    editing, on_d, on_i = cfg_flags(cfg)
    lev = on_d or on_i
    lo, hi = b * K, (b + 1) * K
    post = iters = 0
    cap = K + cfg.max_post_steps + 1
    while True:
        cand = stub.ref_candidates(x, lo, hi, lev)
        iters += 1
        ops = {}
        if lev and iters < cap:
            want = []
            for i in range(max(lo, start), hi):
                if all(x[j] == MASK for j in range(i, hi)):
                    continue
                _, _, pd, pi = cand[i]
                if on_d and pd > cfg.tau_delete and pd >= (pi if on_i else -1.0):
                    want.append((-pd, i, "del"))
                elif on_i and pi > cfg.tau_insert and pi > (pd if on_d else -1.0):
                    want.append((-pi, i, "ins"))
            ops = {i: op for _, i, op in sorted(want)[:cfg.max_lev_edits]}
        masks = [i for i in range(lo, hi) if i >= start and x[i] == MASK]
        free = [i for i in masks if i not in ops]
        gamma = [i for i in free if cand[i][1] > cfg.tau_mask]
        if len(gamma) < cfg.num_to_transfer:
            gamma = sorted(free, key=lambda i: (-cand[i][1], i))[:cfg.num_to_transfer]
        delta = []
        if editing:
            delta = [i for i in range(max(lo, start), hi)
                     if i not in ops and x[i] != MASK and cand[i][0] != x[i] and cand[i][1] > cfg.tau_edit]
        old = x[lo:hi]
        log = [(i - rs.P, x[i], cand[i][0]) for i in delta]
        for i in gamma + delta:
            x[i] = cand[i][0]
            rs.trace[i] = rs.forwards
        if ops:
            rs.lev_drafts.setdefault(b, old)
            log += [(i - rs.P, old[i - lo], DEL_ID if op == "del" else INS_ID) for i, op in ops.items()]
            cells = []
            for i in range(lo, hi):
                if ops.get(i) == "ins":
                    cells += [(MASK, -1), (x[i], rs.trace[i])]
                elif ops.get(i) != "del":
                    cells.append((x[i], rs.trace[i]))
            cells = (cells + [(MASK, -1)] * K)[:K]
            x[lo:hi] = [c[0] for c in cells]
            rs.trace[lo:hi] = [c[1] for c in cells]
            rs.deletes += sum(op == "del" for op in ops.values())
            rs.inserts += sum(op == "ins" for op in ops.values())
        rs.edit_log += sorted(log)
        rs.edits += len(delta) + len(ops)
        rs.forwards += 1
        if not masks:
            post += 1
        left = sum(1 for i in range(lo, hi) if i >= start and x[i] == MASK)
        edited = bool(delta or ops)
        done = (not masks and not edited) or (left == 0 and (post >= cfg.max_post_steps or not (editing or lev)))
        done = done or iters >= cap
        if cfg.early_commit is not None and masks and left == 0 and not edited:
            done = done or all(cand[i][1] > cfg.early_commit for i in gamma)
        if lev:
            done = done and left == 0
        rs.snapshots.append(list(x))
        rs.events.append(("block", b, done))
        if done:
            return


def ref_mbe(stub: StubModel, rs: RefSeq, b: int, window_lo: int, start: int, cfg) -> None:
    """The Multi-Block Editing passes after block b ended, window blocks [window_lo, b]."""
    K, x = stub.config.block_size, rs.x
    lev = cfg_flags(cfg)[1] or cfg_flags(cfg)[2]
    lo, hi = window_lo * K, (b + 1) * K
    for _ in range(cfg.mbe_max_passes):
        cand = stub.ref_candidates(x, lo, hi, lev)
        change = [i for i in range(lo, hi) if i >= start and cand[i][0] != x[i] and cand[i][1] > cfg.mbe_tau]
        rs.edit_log += [(i - rs.P, x[i], cand[i][0]) for i in change]
        for i in change:
            x[i] = cand[i][0]
            rs.trace[i] = rs.forwards
        rs.mbe_edits += len(change)
        rs.edits += len(change)
        rs.forwards += 1
        rs.snapshots.append(list(x))
        rs.events.append(("mbe", b, True))
        if not change:
            return


def ref_turn_blocks(stub, rs: RefSeq, start: int, num_blocks: int, cfg, stop, version_from=None):
    """Decode blocks start // K, ... until `stop(b)` says the block ends the turn / sequence, or the last of
    `num_blocks`; MBE after each block that has an earlier block of the turn (from `version_from(b)`, the
    first block of the same weights, when given). Returns the last block decoded."""
    K = stub.config.block_size
    first = start // K
    b = first
    while True:
        ref_block(stub, rs, b, start, cfg)
        lo = first if version_from is None else max(first, version_from(b))
        if cfg.mbe_window > 0 and b > lo:
            ref_mbe(stub, rs, b, max(lo, b - cfg.mbe_window), start, cfg)
        if stop(b) or b + 1 >= num_blocks:
            return b
        b += 1


def ref_single(stub: StubModel, prompt: list[int], M: int, cfg, version_from=None) -> RefSeq:
    """One single-turn sequence: M generated positions, blocks up to ceil((P + M) / K), stop after the block
    whose generated region [P, min(P + M, block end)) first holds EOS (when cfg.stop_at_eos)."""
    K, P = stub.config.block_size, len(prompt)
    nb = -(-(P + M) // K)
    rs = RefSeq(list(prompt) + [MASK] * (nb * K - P), P)
    rs.num_blocks = nb

    def stop(b):
        return cfg.stop_at_eos and EOS in rs.x[P:min(P + M, (b + 1) * K)]
    ref_turn_blocks(stub, rs, P, nb, cfg, stop, version_from)
    return rs


def ref_output(rs: RefSeq, M: int, K: int) -> dict:
    """What `GenerationOutput` documents: tokens cut to M and after the first EOS (kept), their traces, the
    block's tail after the last token."""
    P = rs.P
    toks, tr = rs.x[P:P + M], rs.trace[P:P + M]
    eos = EOS in toks
    if eos:
        n = toks.index(EOS) + 1
        toks, tr = toks[:n], tr[:n]
    end = P + len(toks)
    return dict(token_ids=toks, trace=tr, finished_by_eos=eos, tail_ids=rs.x[end:-(-end // K) * K],
                num_forwards=rs.forwards, tpf=len(toks) / max(rs.forwards, 1), num_edits=rs.edits,
                num_mbe_edits=rs.mbe_edits, edit_log=rs.edit_log, num_deletes=rs.deletes, num_inserts=rs.inserts,
                lev_drafts=[(b * K - P, d) for b, d in sorted(rs.lev_drafts.items())])


class StubTokenizer:
    """Token ids <-> text: id t is the letter chr(97 + t); [MASK], EOS and id 8 are special tokens: dropped with
    skip_special_tokens, else written as <t>; `tool` (an id) decodes to "</tool_call>". Text encodes letter by
    letter (other characters, and the letters of special or edit-control ids: id 0); add_special_tokens (the
    Hugging Face default) puts a BOS-like id 9 first; as with the project's fast tokenizer, the flag must be a
    bool (`PreTrainedTokenizerFast` raises TypeError for None)."""

    SPECIAL = (MASK, EOS, 8)

    def __init__(self, tool: int | None = None):
        self.tool = tool

    def decode(self, ids, skip_special_tokens=False):  # a Hugging Face tokenizer's default
        out = []
        for t in ids:
            if t in self.SPECIAL:
                if not skip_special_tokens:
                    out.append(f"<{t}>")
                continue
            out.append("</tool_call>" if t == self.tool else chr(97 + t))
        return "".join(out)

    def __call__(self, text, add_special_tokens=True):
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"{add_special_tokens!r} is not an instance of 'bool'")
        ids = [ord(c) - 97 if "a" <= c <= chr(97 + V - 1) and ord(c) - 97 not in self.SPECIAL + (DEL_ID, INS_ID) else 0
               for c in text]
        return {"input_ids": ([9] if add_special_tokens else []) + ids}


def ref_multiturn(stub: StubModel, prompt: list[int], step, cfg, mt, tok: StubTokenizer, T: int) -> dict:
    """One multi-turn trajectory, written from rollout/sequence.py's state machine and TurnRecord's fields:
    each turn decodes blocks from its `start` (prompt end, or the last observation's end) until a block whose
    turn text holds EOS ("eos"), a closed tool call ("tool_call", with mt.stop_at_tool_call) or the turn's
    last block (min of start + max_turn_tokens, the total budget, the canvas, in whole blocks: "budget");
    the turn keeps its last block whole. step(turn index, text) -> (observation, reward, done, info) or
    raises; then the trajectory ends (done, max_turns, an error, no room for the observation) or the
    observation's tokens follow the turn and the next turn starts after them."""
    K, P = stub.config.block_size, len(prompt)
    budget = min(T, mt.max_total_tokens)
    rs = RefSeq(list(prompt) + [MASK] * (T - P), P)
    x = rs.x
    out = dict(rs=rs, turns=[], generated=[False] * T, segment=[0] * P + [-1] * (T - P), length=P, stop="",
               failed=False, error=None)
    if P >= budget:
        out["stop"] = "max_total_tokens"
        return out
    start = P
    while True:
        nb = min(-(-(start + mt.max_turn_tokens) // K) * K, -(-budget // K) * K, T) // K
        why = {}

        def stop(b):
            toks = x[start:(b + 1) * K]
            cut = toks.index(EOS) if EOS in toks else None
            why["text"] = tok.decode(toks if cut is None else toks[:cut], skip_special_tokens=True)
            if cut is not None:
                why["by"] = "eos"
            elif mt.stop_at_tool_call and "</tool_call>" in why["text"]:
                why["by"] = "tool_call"
            return "by" in why
        f0 = rs.forwards
        b = ref_turn_blocks(stub, rs, start, nb, cfg, stop)
        end = (b + 1) * K
        for i in range(start, end):
            out["generated"][i], out["segment"][i] = True, 2 * len(out["turns"]) + 1
        out["length"] = end
        turn = dict(start=start, end=end, text=why["text"], finished_by=why.get("by", "budget"),
                    forwards=rs.forwards - f0)
        out["turns"].append(turn)
        try:
            obs, reward, done, info = step(len(out["turns"]) - 1, turn["text"])
        except Exception as e:  # noqa: BLE001 - the reference of an env failure
            out.update(stop="env_error", failed=True, error=f"{type(e).__name__}: {str(e)[:200]}")
            return out
        turn.update(reward=float(reward), done=bool(done))
        if done:
            out["stop"] = "done"
            return out
        if len(out["turns"]) >= mt.max_turns:
            out["stop"] = "max_turns"
            return out
        ids = tok(mt.observation_template.format(observation=obs or ""), add_special_tokens=False)["input_ids"]
        lo = end
        if lo + len(ids) + 1 > budget:
            empty = len(tok(mt.observation_template.format(observation=""), add_special_tokens=False)["input_ids"])
            if lo + empty + 1 > budget:
                out["stop"] = "max_total_tokens"
            else:
                turn["observation"] = obs
                out.update(stop="observation_overflow", error=f"observation of {len(ids)} tokens does not fit: "
                                                                f"{lo} tokens so far, max_total_tokens {budget}")
            return out
        x[lo:lo + len(ids)] = ids
        for i in range(lo, lo + len(ids)):
            out["segment"][i] = 2 * len(out["turns"])
        turn.update(obs_start=lo, obs_end=lo + len(ids), observation=obs)
        start = out["length"] = lo + len(ids)
