"""rollout/forward.py with a stub model: which slice each row runs, what the
model is called with, and each row's candidates against a per-row plain reference.

The stub records its call and returns hidden states that are a fixed function of (row, slot); its lm_head
is a random linear map. The reference computes each row on its own (batch of one, its own generator):
the rows sharing a forward must not change a row's candidates.
"""
from types import SimpleNamespace

import pytest
import torch

from rollout.config import DecodeConfig
from rollout.forward import RowPlan, plan_rows, row_candidates, run_model
from rollout.layout import build_layout
from rollout.sampling import candidates_reference

V, H, MASK = 23, 6, 5


class StubModel:
    """Records the forward's keyword arguments; hidden = a function of the input ids and positions."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(V, H, generator=g) * 3)
        self.emb = torch.randn(V, H, generator=g)
        self.calls = []

    def __call__(self, input_ids, **kw):
        self.calls.append(dict(input_ids=input_ids, **kw))
        hidden = self.emb[input_ids] + 0.01 * kw["position_ids"][..., None].float()
        return SimpleNamespace(last_hidden_state=hidden)


def seq(slot, block, mbe_start=None):
    return SimpleNamespace(slot=slot, block=block, mbe_start=mbe_start)


@pytest.mark.parametrize("cached", [True, False])
def test_plan_rows(cached):
    K = 4
    cache = SimpleNamespace(lengths=[8, 0, 12, 4]) if cached else None
    seqs = [seq(0, 3), seq(2, 5, mbe_start=2), seq(1, 0), seq(3, 2, mbe_start=0)]
    plan = plan_rows(seqs, cache, K)
    want_q = []
    for s in seqs:
        lo = (s.mbe_start if s.mbe_start is not None else s.block) * K
        if not cached:
            want_q.append(0)
        else:
            want_q.append(lo if s.mbe_start is not None else cache.lengths[s.slot])
    assert plan.q_start == want_q
    assert plan.q_end == [(s.block + 1) * K for s in seqs]
    assert plan.clamp == [s.mbe_start for s in seqs]
    assert plan.t_start == [(s.mbe_start if s.mbe_start is not None else s.block) * K for s in seqs]
    assert plan.t_len == [(s.block + 1 - (s.mbe_start if s.mbe_start is not None else s.block)) * K for s in seqs]


def _canvas(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, V, (B, T), generator=g)
    c[c == MASK] = 0
    c[:, T // 2:] = MASK  # masks at the tail, as a canvas being decoded
    return c


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("ragged", [True, False])
def test_run_model_calls_the_model_with_the_layout(cached, ragged):
    K, T = 4, 24
    canvas = _canvas(5, T)
    slots = [3, 1, 4]
    lengths = [0, 8, 0, 4, 12]
    cache = SimpleNamespace(lengths=lengths) if cached else None
    # equal slice lengths from different starts are not ragged; unequal ones are
    q_start = ([4, 12, 8] if ragged else [4, 8, 8]) if cached else ([0, 0, 4] if ragged else [0, 4, 4])
    plan = RowPlan(q_start=q_start, q_end=[12, 16, 16], clamp=[None, None, 1], t_start=[8, 12, 4], t_len=[4, 4, 12])
    model = StubModel()
    out = run_model(model, canvas, slots, plan, cache, K, MASK)
    (call,) = model.calls
    S = max(lengths[r] for r in slots) if cached else 0
    assert S == (12 if cached else 0)
    lay = build_layout(canvas[slots], plan.q_start, plan.q_end, K, plan.clamp, S, MASK)
    assert torch.equal(call["input_ids"], lay.input_ids)
    assert torch.equal(call["attention_mask"], lay.keep)
    assert torch.equal(call["position_ids"], lay.position_ids)
    assert call["cache"] is cache
    assert call["cache_rows"] == (slots if cached else None)
    assert call["return_logits"] is False
    lens = [e - s for s, e in zip(plan.q_start, plan.q_end)]
    assert (min(lens) < max(lens)) == ragged
    if ragged:
        assert torch.equal(call["token_mask"], lay.valid)
    else:
        assert call["token_mask"] is None
    assert set(call) == {"input_ids", "attention_mask", "position_ids", "cache", "cache_rows", "return_logits",
                         "token_mask"}
    assert torch.equal(out, model.emb[lay.input_ids] + 0.01 * lay.position_ids[..., None].float())


def _reference_row(model, hidden_row, canvas_row, off, t_start, length, cfg, gen, lev_ids):
    """One row alone: the documented candidate rule, written out."""
    h = hidden_row[off:off + length][None]
    logits = model.lm_head(h).float()
    logits[..., MASK] = float("-inf")
    eprob = None
    if lev_ids is not None:
        eprob = logits.softmax(-1)[..., list(lev_ids)]
        logits[..., list(lev_ids)] = float("-inf")
    suppress = None
    if cfg.repetition_penalty:
        prev = [-1 if p == 0 or int(canvas_row[p - 1]) == MASK else int(canvas_row[p - 1])
                for p in range(t_start, t_start + length)]
        suppress = torch.tensor([prev])
    tok, prob = candidates_reference(logits, cfg.temperature, cfg.top_k, cfg.top_p,
                                     [gen] if cfg.temperature > 0 else None, suppress, cfg.repetition_penalty)
    return tok[0], prob[0], None if eprob is None else eprob[0]


CFGS = [DecodeConfig(), DecodeConfig(repetition_penalty=2.5), DecodeConfig(temperature=0.9, top_k=7, top_p=0.8),
        DecodeConfig(temperature=1.3, repetition_penalty=1.0)]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("lev_ids", [None, (7, 9)])
def test_row_candidates_equal_each_row_alone(cfg, lev_ids):
    T = 24
    canvas = _canvas(5, T, seed=2)
    canvas[1, 0] = 3  # position 0: nothing before it to penalise
    canvas[4, 7] = MASK  # a mask before a target position: nothing penalised there either
    slots = [4, 1, 2, 0]
    # rows of two target lengths (two groups), offsets inside the forward's slice differ
    plan = RowPlan(q_start=[4, 0, 8, 0], q_end=[12, 4, 16, 16], clamp=[None, None, None, 2],
                   t_start=[8, 0, 12, 8], t_len=[4, 4, 4, 8])
    model = StubModel(seed=3)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(len(slots), 16, H, generator=g)
    seeds = [11, 12, 13, 14]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    got = row_candidates(model, hidden, canvas, slots, plan, gens, cfg, MASK, lev_ids)
    assert len(got) == len(slots)
    for i, r in enumerate(slots):
        ref_gen = torch.Generator().manual_seed(seeds[i])
        off = plan.t_start[i] - plan.q_start[i]
        tok, prob, eprob = _reference_row(model, hidden[i], canvas[r], off, plan.t_start[i], plan.t_len[i], cfg,
                                          ref_gen, lev_ids)
        assert torch.equal(got[i][0], tok), i
        assert got[i][0].dtype == torch.long and got[i][1].dtype == torch.float32
        torch.testing.assert_close(got[i][1], prob, rtol=1e-5, atol=1e-6)
        assert not (got[i][0] == MASK).any()
        if lev_ids is None:
            assert got[i][2] is None
        else:
            assert got[i][2].shape == (plan.t_len[i], 2)
            torch.testing.assert_close(got[i][2], eprob, rtol=1e-5, atol=1e-7)
            assert not torch.isin(got[i][0], torch.tensor(lev_ids)).any()


def test_greedy_ignores_generators_and_sampling_uses_each_row_s_own():
    K = 4
    canvas = _canvas(3, 16, seed=4)
    slots = [0, 1, 2]
    plan = RowPlan(q_start=[4, 4, 4], q_end=[8, 8, 8], clamp=[None] * 3, t_start=[4, 4, 4], t_len=[K] * 3)
    model = StubModel(seed=5)
    hidden = torch.zeros(3, 4, H)
    hidden[:] = torch.randn(1, 4, H, generator=torch.Generator().manual_seed(1)) * 0.05  # near-flat logits
    cfg = DecodeConfig(temperature=1.0)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 1)]
    got = row_candidates(model, hidden, canvas, slots, plan, gens, cfg, MASK, None)
    assert torch.equal(got[0][0], got[2][0])  # same seed, same hidden: same draw
    draws = [row_candidates(model, hidden, canvas, slots, plan,
                            [torch.Generator().manual_seed(s) for s in (1, 2, 1)], cfg, MASK, None)[1][0]
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], got[1][0])
    # greedy: the generators are not consumed
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 1)]
    states = [x.get_state() for x in gens]
    row_candidates(model, hidden, canvas, slots, plan, gens, DecodeConfig(), MASK, None)
    assert all(torch.equal(x.get_state(), s) for x, s in zip(gens, states))


@pytest.mark.parametrize("lev_ids", [None, (7, 9)])
def test_row_candidates_stay_on_the_hidden_states_device(lev_ids):
    """Every tensor made here goes to the device of `hidden` (`meta` stands in for an accelerator: mixing it
    with a CPU tensor raises, as a CUDA tensor does)."""
    model = StubModel(seed=6)
    model.lm_head.to("meta")
    canvas = _canvas(3, 16, seed=7).to("meta")
    plan = RowPlan(q_start=[4, 0, 8], q_end=[12, 8, 16], clamp=[None] * 3, t_start=[8, 4, 12], t_len=[4, 4, 4])
    hidden = torch.zeros(3, 8, H, device="meta")
    cfg = DecodeConfig(repetition_penalty=2.0)
    got = row_candidates(model, hidden, canvas, [2, 0, 1], plan, [None] * 3, cfg, MASK, lev_ids)
    for tok, prob, eprob in got:
        assert tok.device.type == "meta" and tok.shape == (4,) and prob.shape == (4,)
        assert eprob is None if lev_ids is None else eprob.device.type == "meta"
