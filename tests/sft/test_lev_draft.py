"""The Levenshtein SFT's next-round draft under the decoder's thresholds (ebpo/sft/lev_draft.py).

* `decoder_next_draft` equals a plain-loop reading of the decoder's rules (`plain_next_draft` below: Python loops
  over rows, blocks and positions, float64 probabilities, nothing shared with `rollout.levenshtein`) on random
  drafts and logits of several shapes and threshold settings, with [MASK]s that have content after them, trailing
  [MASK]s, prompts that end inside a block and blocks with more confident operations than `max_lev_edits`;
* without a `next_draft` (`lev_draft.preset: null`) `levenshtein_loss` is today's argmax chain bit for bit;
* an SFT run of the tiny model with the decoder draft on trains, and its first Levenshtein round is the
  argmax run's bit for bit (only the later rounds' drafts differ);
* the `lev_draft` section refuses unknown keys and bad values at start-up, naming the key.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from ebpo.core.lev_objective import apply_predictions, corrupt_blocks, lev_round, levenshtein_loss
from ebpo.core.objectives import ObjectiveConfig, noisy_half_hidden
from ebpo.infra.config import ConfigError, load_config
from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.sft.config import SFTConfig
from ebpo.sft.lev_draft import decoder_next_draft
from ebpo.sft.trainer import run
from rollout.config import DecodeConfig

V, MASK, DEL, INS = 16, 2, 13, 14  # a small vocabulary: ids 3..12 are content, 15 is never drawn
NEAR = 1e-5  # a case whose float64 decision lies this close to a threshold or a tie is redrawn (fp32 vs fp64)


def _softmax(xs):
    finite = [x for x in xs if x != -math.inf]
    top = max(finite)
    e = [math.exp(x - top) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def plain_next_draft(draft, logits, editable, K, cfg, stats):
    """The decoder's block step, read one rule at a time (rollout/levenshtein.py and rollout/steps.py docstrings).

    draft, editable: lists of rows; logits: {(b, i): list of V floats} at the editable positions. Returns the next
    draft (lists) and whether a decision came within NEAR of its threshold or of a tie (then the caller redraws).
    """
    def on(t):
        return t is not None and t >= 0

    near = False
    out = []
    for b, row in enumerate(draft):
        new_row = []
        for k in range(len(row) // K):
            pos = list(range(k * K, (k + 1) * K))
            cur = [row[i] for i in pos]
            ed = [editable[b][i] for i in pos]
            pd, pi, tok, prob = [0.0] * K, [0.0] * K, list(cur), [0.0] * K
            for j, i in enumerate(pos):
                if not ed[j]:
                    continue
                x = list(logits[(b, i)])
                x[MASK] = -math.inf  # a written token is never [MASK]; the edit probabilities exclude it too
                p = _softmax(x)
                pd[j], pi[j] = p[DEL], p[INS]
                x[DEL] = x[INS] = -math.inf  # a written token is never DELETE or INSERT
                p = _softmax(x)
                tok[j] = max(range(V), key=lambda v: (p[v], -v))
                prob[j] = p[tok[j]]
            # DELETE / INSERT: editable, not a [MASK] with nothing but [MASK]s after it, over the threshold, the
            # likelier of the two; then the most confident max_lev_edits (ties: the earlier position)
            wanted = []
            for j in range(K):
                noop = all(c == MASK for c in cur[j:])
                if not ed[j]:
                    continue
                d = pd[j] if on(cfg.tau_delete) else -1.0
                n = pi[j] if on(cfg.tau_insert) else -1.0
                for a, t in ((d, cfg.tau_delete), (n, cfg.tau_insert)):
                    near |= on(t) and abs(a - t) < NEAR
                near |= on(cfg.tau_delete) and on(cfg.tau_insert) and abs(d - n) < NEAR
                op = None
                if on(cfg.tau_delete) and d > cfg.tau_delete and d >= n:
                    op = ("DEL", d)
                elif on(cfg.tau_insert) and n > cfg.tau_insert and n > d:
                    op = ("INS", n)
                if op is not None and noop:
                    stats["noop_refused"] += 1
                    continue
                if op is not None:
                    wanted.append((op[1], j, op[0]))
            wanted.sort(key=lambda w: (-w[0], w[1]))
            for a, c in zip(wanted, wanted[1:]):
                near |= abs(a[0] - c[0]) < NEAR
            stats["capped"] += max(0, len(wanted) - cfg.max_lev_edits)
            ops = {j: kind for _, j, kind in wanted[:cfg.max_lev_edits]}
            for j, kind in ops.items():
                if cur[j] == MASK:
                    stats[f"{kind}_on_mask"] += 1
            # M2T over the remaining [MASK]s: those over tau_mask, or the num_to_transfer most confident
            masks = [j for j in range(K) if ed[j] and cur[j] == MASK and j not in ops]
            for j in masks:
                near |= abs(prob[j] - cfg.tau_mask) < NEAR
            by_conf = sorted(masks, key=lambda j: (-prob[j], j))
            for a, c in zip(by_conf, by_conf[1:]):
                near |= abs(prob[a] - prob[c]) < NEAR
            passing = [j for j in masks if prob[j] > cfg.tau_mask]
            fill = passing if len(passing) >= cfg.num_to_transfer else by_conf[:cfg.num_to_transfer]
            # T2T over the remaining visible tokens: a different candidate over tau_edit
            rewrite = []
            if on(cfg.tau_edit):
                for j in range(K):
                    if ed[j] and cur[j] != MASK and j not in ops and tok[j] != cur[j]:
                        near |= abs(prob[j] - cfg.tau_edit) < NEAR
                        if prob[j] > cfg.tau_edit:
                            rewrite.append(j)
            written = [tok[j] if j in fill or j in rewrite else cur[j] for j in range(K)]
            block = []
            for j in range(K):
                if ops.get(j) == "DEL":
                    continue  # removed: the tokens after it move left
                if ops.get(j) == "INS":
                    block.append(MASK)  # x_j becomes ([MASK], x_j)
                block.append(written[j])
            new_row += (block + [MASK] * K)[:K]  # padded with [MASK] or cut at the tail
        out.append(new_row)
    return out, near


def _case(B, L, K, seed):
    """A random draft (prompts ending anywhere, [MASK]s inside and at the tail of blocks) and logits whose
    DELETE / INSERT probabilities often cross the thresholds."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(3, 13, (B, L), generator=g)
    prompt = torch.randint(0, L - 1, (B,), generator=g)
    editable = torch.arange(L)[None] >= prompt[:, None]
    inside = torch.rand(B, L, generator=g) < 0.3
    draft = draft.masked_fill(editable & inside, MASK)
    draft = draft.masked_fill(~editable & (torch.rand(B, L, generator=g) < 0.1), MASK)  # left alone, as the decoder
    for b in range(B):  # a [MASK] tail in some blocks: the no-op positions
        for k in range(L // K):
            if torch.rand(1, generator=g).item() < 0.5:
                cut = k * K + int(torch.randint(1, K + 1, (1,), generator=g))
                draft[b, cut:(k + 1) * K] = torch.where(editable[b, cut:(k + 1) * K], MASK, draft[b, cut:(k + 1) * K])
    logits = torch.randn(B, L, V, generator=g) * 2
    boost = torch.rand(B, L, 2, generator=g)
    logits[..., DEL] += torch.where(boost[..., 0] < 0.35, 4.0 + 3 * torch.rand(B, L, generator=g), torch.zeros(B, L))
    logits[..., INS] += torch.where(boost[..., 1] < 0.35, 4.0 + 3 * torch.rand(B, L, generator=g), torch.zeros(B, L))
    logits[..., 3:13] += torch.where(torch.rand(B, L, 1, generator=g) < 0.5, 3.0, 0.0) * \
        torch.nn.functional.one_hot(torch.randint(0, 10, (B, L), generator=g), 10)
    return draft, editable, logits


SETTINGS = [
    DecodeConfig.preset("quality", tau_delete=0.5, tau_insert=0.5, max_lev_edits=2),
    DecodeConfig.preset("speed", tau_delete=0.3, tau_insert=0.4, max_lev_edits=1),
    DecodeConfig.preset("quality", tau_delete=0.2, tau_insert=None, num_to_transfer=2, max_lev_edits=3),
    DecodeConfig.preset("m2t", tau_delete=-1.0, tau_insert=0.0, max_lev_edits=2),
    DecodeConfig.preset("quality", tau_mask=0.3, tau_edit=0.1, tau_delete=0.6, tau_insert=0.6, max_lev_edits=8),
]


@pytest.mark.parametrize("B,L,K", [(3, 16, 4), (2, 24, 8), (4, 12, 3), (1, 32, 16)])
def test_next_draft_equals_plain_loop_of_the_decoder_rules(B, L, K):
    stats = {"noop_refused": 0, "capped": 0, "DEL_on_mask": 0, "INS_on_mask": 0}
    checked = 0
    for c, cfg in enumerate(SETTINGS):
        step = decoder_next_draft(cfg, MASK, DEL, INS)
        for seed in range(6):
            draft, editable, logits = _case(B, L, K, 1000 * c + seed)
            got = step(draft, logits[editable], editable, K)
            lg = {(b, i): logits[b, i].double().tolist() for b in range(B) for i in range(L) if editable[b, i]}
            want, near = plain_next_draft(draft.tolist(), lg, editable.tolist(), K, cfg, stats)
            if near:
                continue
            checked += 1
            assert got.tolist() == want, (cfg, seed)
            assert torch.equal(got[~editable], draft[~editable])  # the prompt is never touched
    assert checked >= 20
    # the cases the rules are about did occur: operations on a [MASK] with content after it, refused no-op tails,
    # more confident operations than max_lev_edits
    assert stats["DEL_on_mask"] > 0 and stats["INS_on_mask"] > 0, stats
    assert stats["noop_refused"] > 0 and stats["capped"] > 0, stats


def test_the_worked_example_acts_on_a_mask_with_content_after_it_and_never_on_the_tail():
    """The worked example: the draft `3?+2_=6 ` (`?` inserted, `_` a [MASK]) of the target `3+2+1=6 `: DELETE the `?`, INSERT
    before the [MASK] (the slot for the `+1` the draft lacks); a confident DELETE at a trailing [MASK] does nothing."""
    t = {c: 3 + i for i, c in enumerate("3?+2=6 1")}
    draft = torch.tensor([[t["3"], t["?"], t["+"], t["2"], MASK, t["="], t["6"], t[" "]],
                          [t["3"], t["+"], t["2"], t["="], MASK, MASK, MASK, MASK]])
    editable = torch.ones_like(draft, dtype=torch.bool)
    logits = torch.full((2, 8, V), -9.0)
    logits[..., 3:11] = 0.0
    for b in range(2):
        for i in range(8):
            logits[b, i, int(draft[b, i]) if draft[b, i] != MASK else t["1"]] = 4.0  # keep / fill with "1"
    logits[0, 1, DEL] = 9.0
    logits[0, 4, INS] = 8.0
    logits[1, 5, DEL] = 9.0  # followed by [MASK]s only: a no-op there
    cfg = DecodeConfig.preset("quality", tau_delete=0.5, tau_insert=0.5, max_lev_edits=2)
    got = decoder_next_draft(cfg, MASK, DEL, INS)(draft, logits[editable], editable, 8)
    assert got[0].tolist() == [t["3"], t["+"], t["2"], MASK, MASK, t["="], t["6"], t[" "]]
    assert got[1].tolist() == [t["3"], t["+"], t["2"], t["="], t["1"], t["1"], t["1"], t["1"]]  # filled, not shifted


def _batch():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 60, (6, 32), generator=g)
    resp = torch.zeros(6, 32, dtype=torch.bool)
    for b, p in enumerate([3, 8, 11, 0, 5, 16]):
        resp[b, p:] = True
    return clean, resp


def _todays_loss(model, clean, resp, first, cfg, generator):
    """levenshtein_loss as it was before `next_draft`: each round's draft is the last one after the argmax edits
    (mask id excluded) at every editable position; the argmax is recomputed here from its own forward."""
    K, allowed = 8, torch.arange(10, 60)
    n = max(1, round(cfg.lev_fraction * clean.shape[0]))
    clean, ed, first = clean[:n], resp[:n].bool(), first[:n]
    corrupt = corrupt_blocks(clean, ed, K, MASK, cfg.lev_rate, allowed, generator)
    if cfg.lev_source == "corrupt":
        draft = corrupt
    elif cfg.lev_source == "model":
        draft = first
    else:
        draft = torch.where((torch.rand(n, generator=generator) < 0.5)[:, None], corrupt, first)
    total, metrics = torch.zeros(()), {}
    for r in range(cfg.lev_rounds):
        loss, m, _ = lev_round(model, model.lm_head, draft, clean, ed, K, MASK, 105, 106, cfg.keep_weight,
                               cfg.lev_edit_weight)
        total = total + loss / cfg.lev_rounds
        metrics[f"loss/lev_round{r + 1}"] = float(loss.detach())
        metrics.update({f"lev/{k}_round{r + 1}": v for k, v in m.items()})
        with torch.no_grad():
            logits = model.lm_head(noisy_half_hidden(model, draft, clean, K)).float()
            logits[..., MASK] = float("-inf")
            draft = apply_predictions(draft, logits.argmax(-1), K, MASK, 105, 106, ed)
    metrics["loss/lev"] = float(total.detach())
    return total, metrics


@pytest.mark.parametrize("source", ["corrupt", "model", "mixed"])
def test_without_next_draft_is_todays_argmax_chain_bit_for_bit(source):
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config())
    clean, resp = _batch()
    first = clean.masked_fill(resp, MASK)
    cfg = ObjectiveConfig(lev_weight=1.0, lev_source=source, lev_rate=0.9, lev_rounds=3, lev_fraction=1.0)
    loss, m = levenshtein_loss(model, model.lm_head, clean, resp, first, cfg, 8, MASK, 105, 106, torch.arange(10, 60),
                               torch.Generator().manual_seed(2))
    want, wm = _todays_loss(model, clean, resp, first, cfg, torch.Generator().manual_seed(2))
    assert loss.item() == want.item() and json.dumps(m, sort_keys=True) == json.dumps(wm, sort_keys=True)
    # a decoder draft changes the later rounds only
    dcfg = DecodeConfig.preset("quality", tau_delete=0.5, tau_insert=0.5)
    _, md = levenshtein_loss(model, model.lm_head, clean, resp, first, cfg, 8, MASK, 105, 106, torch.arange(10, 60),
                             torch.Generator().manual_seed(2), next_draft=decoder_next_draft(dcfg, MASK, 105, 106))
    assert md["loss/lev_round1"] == m["loss/lev_round1"] and md["loss/lev_round2"] != m["loss/lev_round2"]


def test_sft_run_with_the_decoder_draft(tmp_path):
    rows = [{"prompt": f"Compute {a}+{b}.", "response": f"\\boxed{{{a + b}}}"} for a in range(10, 16) for b in range(20, 24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["model=preset:tiny@0", f"data.train={tmp_path / 'train.jsonl'}", "data.max_len=48", "trainer.batch_size=8",
              "trainer.steps=2", "trainer.log_every=1", "trainer.tracking=none", "trainer.progress=false",
              "trainer.plots=false", "trainer.num_threads=1", "eval.presets=[]", "objective.lev_weight=1.0",
              "objective.lev_rounds=2", "objective.lev_fraction=1.0"]

    def metrics(name, *extra):
        out = run(None, common + [f"trainer.run_dir={tmp_path / name}", *extra])
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    on = metrics("on")  # the default: quality, tau_delete = tau_insert = 0.5, max_lev_edits 2
    off = metrics("off", "lev_draft.preset=null")
    assert all(math.isfinite(r["loss/lev_round2"]) for r in on)
    assert on[0]["loss/lev_round1"] == off[0]["loss/lev_round1"] and on[0]["loss/m2t"] == off[0]["loss/m2t"]
    assert on[0]["loss/lev_round2"] != off[0]["loss/lev_round2"]


@pytest.mark.parametrize("override,key", [
    ("lev_draft.bogus=1", "lev_draft.bogus"),
    ("lev_draft.preset=fast", "lev_draft.preset"),
    ("lev_draft.tau_delete=1.5", "lev_draft.tau_delete"),
    ("lev_draft.tau_insert=yes", "lev_draft.tau_insert"),
    ("lev_draft.max_lev_edits=0", "lev_draft.max_lev_edits"),
    ("lev_draft.decode={temperature: 1.0}", "lev_draft.decode.temperature"),
    ("lev_draft.decode={tau_delete: 0.2}", "lev_draft.decode.tau_delete"),
    ("lev_draft.decode={tau_mask: 2}", "lev_draft.decode.tau_mask"),
    ("lev_draft.decode={num_to_transfer: 0}", "lev_draft.decode.num_to_transfer"),
])
def test_lev_draft_section_refuses_bad_keys_naming_them(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(SFTConfig, "recipes/sft_tiny_lev.yaml", [override])


def test_lev_draft_section_resolves_to_the_decoder_settings():
    cfg = load_config(SFTConfig, "recipes/sft_tiny_lev.yaml", ["lev_draft.decode={tau_edit: 0.3}"])
    d = cfg.lev_draft.decode_config()
    assert (d.tau_mask, d.tau_edit, d.num_to_transfer, d.tau_delete, d.tau_insert, d.max_lev_edits) == \
        (0.7, 0.3, 1, 0.5, 0.5, 2)
    assert load_config(SFTConfig, None, ["lev_draft.preset=null"]).lev_draft.decode_config() is None
