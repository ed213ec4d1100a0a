"""SFT with Levenshtein rounds (ebpo.core.lev_objective): drafts, labels, loss, and the trainer wiring.

The rules, each against a plain reading:

* `corrupt_blocks` (module docstring): an inserted token is drawn from every allowed id; each editable position is
  masked with its block's level, drawn from U[0, 0.5), by its own coin (independent between positions and rows);
  with `rate` 0 nothing but masks changes;
* `lev_round` weighs each editable position as its docstring says: `keep_weight` where the label is the draft's
  own token (keep), `edit_weight` (default 1) where it is DELETE or INSERT, 1 elsewhere, summed and divided by the
  number of editable positions; nothing outside the editable positions counts;
* `levenshtein_loss` trains on the first round(lev_fraction * B) rows, at least one, and calls `next_draft` for
  each later round only (lev_rounds - 1 times, on that round's draft); its tensors follow the inputs' device.

The statistical checks use fixed seeds; each bound is Hoeffding's for independent terms in [0, 1]
(P(|mean - E| >= eps) <= 2 exp(-2 n eps^2)), sized in the test so that a false failure has probability < 1e-8."""
import json
import math
import random

import pytest
import torch

from ebpo.core.lev_objective import apply_predictions, block_labels, corrupt_blocks, lev_round, levenshtein_loss
from ebpo.core.levenshtein import rounds_to_target
from ebpo.core.objectives import ObjectiveConfig, noisy_half_hidden
from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.sft.trainer import run
from tests.support import lev_reference as ref
from tests.support.devices import assert_same, under_default

K, MASK, DEL, INS = 8, 2, 105, 106


def _batch():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 60, (6, 32), generator=g)
    resp = torch.zeros(6, 32, dtype=torch.bool)
    for b, p in enumerate([3, 8, 11, 0, 5, 16]):
        resp[b, p:] = True
    return clean, resp


def test_corruptions_keep_prompts_and_block_lengths_and_are_seeded():
    clean, resp = _batch()
    allowed = torch.arange(10, 60)
    a = corrupt_blocks(clean, resp, K, MASK, 0.9, allowed, torch.Generator().manual_seed(1))
    b = corrupt_blocks(clean, resp, K, MASK, 0.9, allowed, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == clean.shape
    assert torch.equal(a[~resp], clean[~resp])  # prompts untouched
    assert not torch.equal(a, clean)
    # every corrupted block goes back to its target under label rounds
    rounds = rounds_to_target(a.view(-1, K), clean.view(-1, K), MASK, max_rounds=8)
    assert (rounds <= 8).all()


def test_labels_of_a_duplicated_token_delete_it_and_prediction_applies():
    clean = torch.tensor([[20, 21, 22, 23, 24, 25, 26, 27]])
    draft = torch.tensor([[20, 21, 21, 22, 23, 24, 25, 26]])  # 21 repeated, 27 pushed out
    lab = block_labels(draft, clean, K, MASK, DEL, INS)
    assert lab.tolist() == [[20, 21, DEL, 22, 23, 24, 25, 26]]
    nxt = apply_predictions(draft, lab, K, MASK, DEL, INS, torch.ones_like(draft, dtype=torch.bool))
    assert nxt.tolist() == [[20, 21, 22, 23, 24, 25, 26, MASK]]


def test_levenshtein_loss_backprops_and_counts_edit_labels():
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config())
    clean, resp = _batch()
    cfg = ObjectiveConfig(lev_weight=1.0, lev_source="mixed", lev_rate=0.9, lev_rounds=2, lev_fraction=1.0)
    loss, m = levenshtein_loss(model, model.lm_head, clean, resp, clean.masked_fill(resp, MASK), cfg, K, MASK, DEL,
                               INS, torch.arange(10, 60), torch.Generator().manual_seed(2))
    loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad[DEL].abs().sum() > 0
    assert m["lev/lev_deletes_round1"] + m["lev/lev_inserts_round1"] > 0
    assert "loss/lev_round2" in m


def test_trainer_runs_levenshtein_rounds(tmp_path):
    rows = [{"prompt": f"Compute {a}+{b}.", "response": f"\\boxed{{{a + b}}}"} for a in range(10, 16) for b in range(20, 24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["model=preset:tiny@0", f"data.train={tmp_path / 'train.jsonl'}", "data.max_len=48", "trainer.batch_size=8",
              "trainer.steps=3", "trainer.log_every=1", "trainer.tracking=none", "trainer.progress=false",
              "trainer.plots=false", "trainer.num_threads=1", "eval.presets=[]"]
    out = run(None, common + [f"trainer.run_dir={tmp_path / 'lev'}", "objective.lev_weight=1.0"])
    m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("loss/lev" in r for r in m)
    base = run(None, common + [f"trainer.run_dir={tmp_path / 'base'}"])
    b = [json.loads(x) for x in (base / "metrics.jsonl").read_text().splitlines()]
    assert "loss/lev" not in b[0] and b[0]["loss/m2t"] == m[0]["loss/m2t"]  # the first round is today's


def test_inserted_tokens_are_drawn_from_every_allowed_id():
    """Clean tokens 10..19, allowed ids {100, 101}: an allowed id in a draft is an inserted token. With rate 1 each
    block's first corruption is an insert of id 100 with probability 1/6; it stays in the block when the second
    corruption is no delete (2/3) and does not push it out (7/8), and it is seen unmasked with probability >= 1/2:
    >= 0.048 per block, so 800 blocks miss it with probability < (1 - 0.048)^800 < 1e-16 (id 101 alike)."""
    B, K, L = 400, 8, 16
    clean = torch.arange(B * L).remainder(10).add(10).view(B, L)
    editable = torch.ones(B, L, dtype=torch.bool)
    allowed = torch.tensor([100, 101])
    out = corrupt_blocks(clean, editable, K, MASK, 1.0, allowed, torch.Generator().manual_seed(0))
    seen = set(out.unique().tolist())
    assert {100, 101} <= seen
    assert seen <= set(range(10, 20)) | {100, 101, MASK}


def _reachable(seg, allowed, n):
    """Every block segment that at most two corruptions (insert an allowed id, delete, duplicate; any position) of
    `seg` give, padded with [MASK] or cut back to `n` tokens."""
    out, frontier = set(), {tuple(seg)}
    for _ in range(3):
        out |= frontier
        nxt = set()
        for s in frontier:
            for at in range(len(s) + 1):
                nxt |= {s[:at] + (a,) + s[at:] for a in allowed}
            for at in range(len(s)):
                nxt |= {s[:at] + s[at + 1:], s[:at] + (s[at],) + s[at:]}
        frontier = nxt
    return {(s + (MASK,) * n)[:n] for s in out}


def test_each_block_is_corrupted_from_its_own_tokens_at_most_twice():
    """Each block's editable segment is its own clean segment after at most two corruptions (rate 1: always two),
    cut back or padded to its length, then partly masked: no token moves between blocks, prompts stay."""
    B, K, L = 24, 6, 18
    clean = torch.arange(10, 10 + B * L).view(B, L)  # every token distinct: a moved token would show
    editable = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        editable[b, b % (2 * K):] = True  # prompts of 0 .. 2K - 1 tokens: whole prompt blocks and partial ones
    allowed = (1000, 1001)
    out = corrupt_blocks(clean, editable, K, MASK, 1.0, torch.tensor(allowed), torch.Generator().manual_seed(3))
    assert torch.equal(out[~editable], clean[~editable])
    for b in range(B):
        for k in range(L // K):
            lo, hi = max(k * K, b % (2 * K)), (k + 1) * K
            if lo >= hi:
                continue
            got = tuple(out[b, lo:hi].tolist())
            cands = _reachable(tuple(clean[b, lo:hi].tolist()), allowed, hi - lo)
            assert any(all(g in (MASK, c) for g, c in zip(got, cand)) for cand in cands), (b, k, got)


def test_blocks_after_a_whole_prompt_block_are_corrupted():
    """Rows whose first block is all prompt: the response blocks after it are still corrupted. Per block at rate 1,
    the first corruption inserts an allowed id at position 0 with probability 1/3 * 1/K, the second leaves it
    there unless it deletes position 0 (1/3 * 1/(K + 1)), and it is unmasked with probability >= 1/2: >= 0.02
    for K = 8. 1200 blocks show no allowed id with probability < 0.98^1200 < 1e-10."""
    B, K, L = 400, 8, 32
    clean = torch.arange(B * L).remainder(40).add(10).view(B, L)
    editable = torch.zeros(B, L, dtype=torch.bool)
    editable[:, K + 2:] = True
    out = corrupt_blocks(clean, editable, K, MASK, 1.0, torch.tensor([100, 101]), torch.Generator().manual_seed(4))
    assert torch.equal(out[:, :K + 2], clean[:, :K + 2])
    assert (out[:, K:] >= 100).any()


def _masking(B, K, L, seed):
    clean = torch.arange(B * L).remainder(7).add(10).view(B, L)  # never MASK
    editable = torch.ones(B, L, dtype=torch.bool)
    out = corrupt_blocks(clean, editable, K, MASK, 0.0, torch.tensor([50]), torch.Generator().manual_seed(seed))
    hidden = out == MASK
    assert torch.equal(out[~hidden], clean[~hidden])  # rate 0: nothing but masks
    return hidden.view(B, L // K, K).float()  # (B, nb, K)


def test_mask_level_is_uniform_below_one_half_per_block():
    """E[fraction of a block masked] = E[level] = 1/4 for levels ~ U[0, 0.5). n = 4000 blocks, eps = 0.05:
    2 exp(-20) < 5e-9. (Levels from U[0, 1) or U[0, 1.5) give a mean of 1/2 or more.)"""
    h = _masking(2000, 8, 16, 1)
    assert abs(h.mean(-1).mean().item() - 0.25) < 0.05


def test_mask_coins_are_independent_between_positions_and_rows():
    """Two positions of one block are both masked with probability E[level^2] = 1/12 (independent coins; 1/4 if
    the block shared one coin). The same position of two rows is masked in both with probability
    E[level]^2 = 1/16 (independent levels and coins; E[min of two levels] = 1/6 if the rows shared their coins).
    Per block (resp. per pair of rows and block) the fraction of such pairs is in [0, 1]; n = 4000 blocks and
    4000 row pairs' blocks, eps = 0.05: 2 exp(-20) < 5e-9 each."""
    h = _masking(4000, 8, 16, 2)  # (B, nb, K)
    K = h.shape[-1]
    both_in_block = (h.sum(-1) ** 2 - h.sum(-1)) / (K * (K - 1))  # ordered pairs i != j both masked
    assert abs(both_in_block.mean().item() - 1 / 12) < 0.05
    both_rows = (h[0::2] * h[1::2]).mean(-1)  # (B/2, nb)
    assert abs(both_rows.mean().item() - 1 / 16) < 0.05


def test_lev_round_edit_weight_defaults_to_one(small_model):
    model = small_model
    K = model.config.block_size
    clean = torch.arange(5, 5 + 3 * K).remainder(5).add(5)[None]
    draft = torch.cat([clean[:, :K + 1], clean[:, K:-1]], 1)  # a duplicated token: a DELETE label, then shifts
    editable = torch.ones_like(clean, dtype=torch.bool)
    with torch.no_grad():
        default, m, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, 0.5)
        one, _, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, 0.5, 1.0)
        two, _, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, 0.5, 2.0)
    assert m["lev_deletes"] + m["lev_inserts"] > 0  # there are edit labels to weigh
    assert float(default) == float(one) != float(two)


def _setup(B=4, K=8, L=32):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 60, (B, L), generator=g)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate([3, 8, 11, 0, 5, 16][:B]):
        resp[b, p:] = True
    return clean, resp, clean.masked_fill(resp, MASK)


@pytest.mark.parametrize("B,fraction", [(4, 0.1), (4, 0.5), (3, 0.9), (5, 0.3)])
def test_lev_rounds_take_the_first_round_fraction_rows_at_least_one(small_model, B, fraction):
    """lev_source "model": the draft is the first round's, so rows [:n] alone give the same loss."""
    model = small_model
    K = model.config.block_size
    clean, resp, first = _setup(B, K, 4 * K)
    n = max(1, round(fraction * B))
    common = dict(lev_weight=1.0, lev_source="model", lev_rate=0.5, lev_rounds=2)
    with torch.no_grad():
        got, m = levenshtein_loss(model, model.lm_head, clean, resp, first,
                                  ObjectiveConfig(**common, lev_fraction=fraction), K, MASK, DEL, INS,
                                  torch.arange(10, 60), torch.Generator().manual_seed(1))
        want, w = levenshtein_loss(model, model.lm_head, clean[:n], resp[:n], first[:n],
                                   ObjectiveConfig(**common, lev_fraction=1.0), K, MASK, DEL, INS,
                                   torch.arange(10, 60), torch.Generator().manual_seed(1))
    assert got.dtype == torch.float32 and float(got) == float(want)
    assert json.dumps(m, sort_keys=True) == json.dumps(w, sort_keys=True)  # NaN-safe
    if n < B:  # and not more rows: all B rows give another loss
        with torch.no_grad():
            more, _ = levenshtein_loss(model, model.lm_head, clean[:n + 1], resp[:n + 1], first[:n + 1],
                                       ObjectiveConfig(**common, lev_fraction=1.0), K, MASK, DEL, INS,
                                       torch.arange(10, 60), torch.Generator().manual_seed(1))
        assert float(more) != float(got)


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_next_draft_builds_each_later_round_only(small_model, rounds):
    model = small_model
    K = model.config.block_size
    clean, resp, first = _setup(3, K, 4 * K)
    calls = []

    def next_draft(draft, logits, editable, block_size):
        calls.append(draft.clone())
        assert logits.shape[0] == int(editable.sum()) and block_size == K and not logits.requires_grad
        return draft.roll(1, -1).masked_scatter(~editable, draft[~editable])  # some other draft, same fixed part

    cfg = ObjectiveConfig(lev_weight=1.0, lev_source="model", lev_rate=0.5, lev_rounds=rounds, lev_fraction=1.0)
    levenshtein_loss(model, model.lm_head, clean, resp, first, cfg, K, MASK, DEL, INS, torch.arange(10, 60),
                     torch.Generator().manual_seed(1), next_draft=next_draft)
    assert len(calls) == rounds - 1
    for r, d in enumerate(calls):  # round r + 1's draft: the first draft rolled r times where editable
        want = first.clone()
        for _ in range(r):
            want = want.roll(1, -1).masked_scatter(~resp, want[~resp])
        assert torch.equal(d, want)


def _plain_corrupt(clean, editable, K, rate, allowed, g):
    """The module docstring's corruption rule in plain Python, reading the same draws as `corrupt_blocks` (drawn
    in this order from the generator): per (row, block) 8 uniforms r (r[0]: how many corruptions, r[1 + 2c] and
    r[2 + 2c]: the kind and place of corruption c), 2 picks of an allowed id, one mask coin per position and one
    mask level per (row, block) (U[0, 1) halved)."""
    B, L = clean.shape
    nb = L // K
    u = torch.rand(B, nb, 8, generator=g)
    picks = torch.randint(0, len(allowed), (B, nb, 2), generator=g)
    coins = torch.rand(B, L, generator=g)
    level = torch.rand(B, nb, generator=g) * 0.5
    out = clean.tolist()
    for b in range(B):
        for k in range(nb):
            pos = [i for i in range(k * K, (k + 1) * K) if editable[b, i]]
            if not pos:
                continue
            seg = [out[b][i] for i in pos]
            r = u[b, k].tolist()
            n_corrupt = (1 if r[0] < rate else 0) + (1 if r[0] < rate * rate else 0)
            for c in range(n_corrupt):
                kind = ("insert", "delete", "duplicate")[int(3 * r[1 + 2 * c])]
                at = int(r[2 + 2 * c] * max(len(seg), 1))
                if kind == "insert":
                    seg = seg[:at] + [int(allowed[picks[b, k, c]])] + seg[at:]
                elif kind == "delete" and seg:
                    del seg[min(at, len(seg) - 1)]
                elif kind == "duplicate" and seg:
                    at = min(at, len(seg) - 1)
                    seg = seg[:at + 1] + seg[at:]
            seg = (seg + [MASK] * len(pos))[:len(pos)]
            for i, t in zip(pos, seg):
                out[b][i] = MASK if coins[b, i] < level[b, k] else t
    return torch.tensor(out)


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 1.0])
def test_corrupt_blocks_is_the_plain_rule(rate):
    B, K, L = 40, 5, 20
    clean = torch.arange(10, 10 + B * L).view(B, L)
    editable = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        editable[b, b % (2 * K):] = True
    allowed = torch.tensor([1000, 1001, 1002])
    got = corrupt_blocks(clean, editable, K, MASK, rate, allowed, torch.Generator().manual_seed(5))
    want = _plain_corrupt(clean, editable, K, rate, allowed, torch.Generator().manual_seed(5))
    assert torch.equal(got, want)


def test_lev_round_metrics_and_predictions_are_the_plain_counts(small_model):
    """lev_deletes / lev_inserts: DELETE / INSERT labels at editable positions; lev_acc_edit: how many of them the
    argmax (the [MASK] id excluded) predicts, NaN without any; predictions: that argmax at editable positions, the
    draft elsewhere. The loss with one editable position is that position's cross-entropy (weight 1: a write)."""
    model = small_model
    K = model.config.block_size
    clean = torch.arange(5, 5 + 3 * K).remainder(7).add(5)[None]
    draft = torch.cat([clean[:, :K + 1], clean[:, K:-1]], 1)  # a duplicated token: DELETE, later INSERT/shifts
    draft[0, 2] = MASK
    editable = torch.ones_like(clean, dtype=torch.bool)
    editable[0, :2] = False
    labels = block_labels(draft, clean, K, MASK, DEL, INS)
    with torch.no_grad():
        raw = model.lm_head(noisy_half_hidden(model, draft, clean, K)).float()
        logits = raw.clone()
        logits[..., MASK] = float("-inf")  # predictions never write [MASK]; the loss is over every id
        loss, m, pred = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, 0.5)
    arg = logits.argmax(-1)
    lab, ed = labels[0].tolist(), editable[0].tolist()
    edits = [p for p in range(clean.shape[1]) if ed[p] and lab[p] in (DEL, INS)]
    assert m["lev_deletes"] == sum(ed[p] and lab[p] == DEL for p in range(len(lab))) >= 1
    assert m["lev_inserts"] == sum(ed[p] and lab[p] == INS for p in range(len(lab)))
    assert m["lev_acc_edit"] == sum(int(arg[0, p]) == lab[p] for p in edits) / len(edits)
    assert torch.equal(pred, torch.where(editable, arg, draft))
    one = torch.zeros_like(editable)
    one[0, 2] = True  # the [MASK]: its label is a token to write
    with torch.no_grad():
        l1, m1, _ = lev_round(model, model.lm_head, draft, clean, one, K, MASK, DEL, INS, 0.5)
    ce = -raw[0, 2].log_softmax(-1)[lab[2]]
    assert lab[2] not in (DEL, INS, MASK) and math.isnan(m1["lev_acc_edit"])
    assert float(l1) == pytest.approx(float(ce), rel=1e-6)  # one fp32 log-softmax over V = 128: ~1e-6 relative


def test_lev_round_weighs_keep_edit_and_other_positions_as_documented(small_model):
    model = small_model
    K = model.config.block_size
    rng = random.Random(4)
    B, L = 4, 4 * K
    clean = torch.tensor([[rng.randint(5, 9) for _ in range(L)] for _ in range(B)])
    draft = clean.clone()
    for b in range(B):  # duplicated, dropped, substituted and masked tokens
        for p in rng.sample(range(L), 6):
            draft[b, p] = rng.choice([MASK, 5, 6, 7, 8, 9, draft[b, max(p - 1, 0)].item()])
    editable = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        editable[b, rng.randint(0, K + 1):] = True
    labels = torch.tensor([[t for k in range(0, L, K)
                            for t in ref.label_ids(draft[b, k:k + K].tolist(), clean[b, k:k + K].tolist(), MASK, DEL, INS)]
                           for b in range(B)])
    with torch.no_grad():
        logp = model.lm_head(noisy_half_hidden(model, draft, clean, K)).float().log_softmax(-1)
    kinds = set()
    for keep_weight, edit_weight in [(0.3, 2.0), (0.0, 1.0), (1.7, 0.25)]:
        with torch.no_grad():
            loss, _, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, keep_weight,
                                   edit_weight)
        total, n = 0.0, 0
        for b in range(B):
            for p in range(L):
                if not editable[b, p]:
                    continue
                n += 1
                lab = int(labels[b, p])
                if lab in (DEL, INS):
                    w, kind = edit_weight, "edit"
                elif lab == int(draft[b, p]):
                    w, kind = keep_weight, "keep"
                else:
                    w, kind = 1.0, "write"
                kinds.add(kind)
                total += -w * float(logp[b, p, lab])
        # fp32 log-softmax of |logits| of a few units, summed over < 100 terms: 1e-5 relative
        assert float(loss) == pytest.approx(total / n, rel=1e-5, abs=1e-6), (keep_weight, edit_weight)
    assert kinds == {"edit", "keep", "write"}  # every kind of position was there to weigh


def test_lev_round_loss_ignores_non_editable_positions(small_model):
    model = small_model
    K = model.config.block_size
    clean = torch.arange(5, 5 + 3 * K).remainder(5).add(5)[None]
    draft = clean.clone()
    draft[0, 1], draft[0, K + 2] = MASK, 9
    editable = torch.zeros_like(clean, dtype=torch.bool)
    editable[0, K:] = True
    with torch.no_grad():
        a, _, _ = lev_round(model, model.lm_head, draft, clean, editable, K, MASK, DEL, INS, 0.5)
        e = torch.zeros_like(editable)
        z, _, _ = lev_round(model, model.lm_head, draft, clean, e, K, MASK, DEL, INS, 0.5)
    assert torch.isfinite(a) and float(z) == 0.0


SMALL_K = 4  # the block size of the small_model fixture


@pytest.mark.parametrize("source", ["corrupt", "mixed"])
def test_levenshtein_loss_follows_the_inputs_device(small_model, source):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 60, (3, 16), generator=g)
    resp = torch.zeros(3, 16, dtype=torch.bool)
    resp[:, 4:] = True
    first = clean.masked_fill(resp, MASK)
    cfg = ObjectiveConfig(lev_weight=1.0, lev_source=source, lev_rate=0.5, lev_rounds=2, lev_fraction=1.0)
    allowed, outs = torch.arange(10, 60), {}
    for dev in (None, "meta"):
        with torch.no_grad(), under_default(dev):
            outs[dev] = levenshtein_loss(small_model, small_model.lm_head, clean, resp, first, cfg, SMALL_K, MASK, DEL,
                                         INS, allowed, torch.Generator().manual_seed(1))
    assert_same(outs[None][0], outs["meta"][0])
    assert_same(outs[None][1], outs["meta"][1])
