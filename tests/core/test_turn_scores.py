"""`score_turns` and `trajectory_tensors` (ebpo.core.turn_scores), the public per-turn scoring recipe.

Checked against a plain loop (each turn's blocks scored one forward each over [clean prefix ; noisy block],
float64) on real multi-turn trajectories of the shipped tiny model, with the noise the function drew; rows batched
with padding score as they do alone. On a small random model and hand-laid turns, each rule against a plain
reading of the module docstring:

* trajectory_tensors: rows right-padded to a whole number of blocks with `pad_id`, not generated, segment -1;
  rows of unequal field lengths and an empty batch refused, naming the row and the lengths;
* score_turns: each turn's score is the sum over its blocks of one forward each over [clean tokens before the
  block ; the block with its masked tokens replaced by the mask id], each masked token weighted (float64 loop);
  the draws are draw_noise's on the turn-aligned response mask with the n_draws, t_min, t_max and seed asked
  (defaults 4, 0.1, 1.0, 0), a generator passed wins over the seed; n_turns counts the model turns (0 for a row
  without one), per_turn has max(1, most turns) columns, zero where a row has no such turn; mean() averages the
  draws; the model's pad id pads (the mask id when it has none); a model turn sharing a block with what follows
  it is refused."""
import pytest
import torch

from ebpo.core.likelihood import draw_noise, turn_response_mask
from ebpo.core.turn_scores import score_turns, trajectory_tensors
from ebpo.core.turns import layout_segments
from ebpo.infra.data import encode_prompt
from ebpo.model import LLaDA2MoeModelLM
from ebpo.model.loading import load_model, load_model_tokenizer
from ebpo.model.presets import tiny_config
from rollout.config import DecodeConfig
from rollout.multiturn import MultiTurnConfig, generate_multiturn


class Scripted:
    """Answers each turn with a short observation; done after `n` turns."""

    def __init__(self, n):
        self.n, self.k = n, 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        return f"obs{self.k}", 0.0, self.k >= self.n, {}


@pytest.fixture(scope="module")
def trajectories():
    model, tok = load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")
    prompts = [encode_prompt(tok, q) for q in ("Compute 12+7.", "Compute 45-3.")]
    trajs = generate_multiturn(model, prompts, [Scripted(3), Scripted(2)], DecodeConfig.preset("quality", mbe_window=0),
                               MultiTurnConfig(max_turn_tokens=16, stop_at_tool_call=False), tokenizer=tok)
    assert [len(t.turns) for t in trajs] == [3, 2] and len(trajs[0].ids) != len(trajs[1].ids)
    return model, trajs


def reference_turn(model, ids, masked, weight, t_end, K, mask_id):
    """One turn by hand: the sequence cut at the turn's end, each of its blocks with a masked token scored by
    its own forward over [clean tokens before the block ; the block with its masked tokens replaced]."""
    total = torch.zeros((), dtype=torch.float64)
    x = torch.tensor(ids[:t_end])
    for b0 in range(0, t_end, K):
        m = masked[b0:b0 + K]
        if not m.any():
            continue
        block = x[b0:b0 + K].clone()
        block[m] = mask_id
        logp = model(torch.cat([x[:b0], block])[None]).logits[0, b0:].double().log_softmax(-1)
        for j in m.nonzero().flatten().tolist():
            total += logp[j, x[b0 + j]] * float(weight[b0 + j])
    return total


def test_score_turns_matches_a_per_turn_per_block_loop(trajectories):
    model, trajs = trajectories
    K, mask_id = model.config.block_size, model.config.mask_token_id
    s = score_turns(model, trajs, n_draws=2, seed=3)
    assert s.per_turn.shape == (2, 2, 3) and s.n_turns.tolist() == [3, 2]
    assert torch.allclose(s.per_turn.sum(-1), s.composite, atol=1e-4)
    assert (s.per_turn[1, :, 2] == 0).all()  # row 1 has two turns
    with torch.no_grad():
        for i, tr in enumerate(trajs):
            for t, turn in enumerate(tr.turns):
                own = torch.zeros(s.noise.masked.shape[-1], dtype=torch.bool)
                own[turn.start:turn.end] = True  # only this turn's tokens are scored
                for n in range(2):
                    ref = reference_turn(model, tr.ids, s.noise.masked[n, i] & own, s.noise.weight[n, i], turn.end,
                                         K, mask_id)
                    # fp32 against float64: ~30 terms of size up to ~100 (log-prob ~10 x weight 1/t_min), each a few fp32
                    # ulps (1.2e-7 relative) off: far under 1e-3
                    assert torch.allclose(s.per_turn[i, n, t].double(), ref, rtol=1e-4, atol=1e-3), (i, t, n)
    assert s.mean().shape == (2, 3)


def test_a_row_scores_the_same_alone_and_padded_in_a_batch(trajectories):
    model, trajs = trajectories
    g = torch.Generator().manual_seed(5)
    both = score_turns(model, trajs, n_draws=2, generator=g)
    # the same masks, cut to the short row's own length, must give the short row's scores alone
    i = min(range(2), key=lambda j: len(trajs[j].ids))
    L = len(trajs[i].ids)
    from ebpo.core.likelihood import NoiseDraws

    alone_noise = NoiseDraws(masked=both.noise.masked[:, i:i + 1, :L], t=both.noise.t[:, i:i + 1, :L // 8],
                             weight=both.noise.weight[:, i:i + 1, :L], block_size=8)
    from ebpo.core.likelihood import all_composites

    with torch.no_grad():
        comp = all_composites(model, torch.tensor([trajs[i].ids]), alone_noise, model.config.mask_token_id)
    assert torch.allclose(comp[0], both.composite[i], atol=1e-4)


def test_dicts_work_and_bad_rows_are_refused(trajectories):
    model, trajs = trajectories
    a = score_turns(model, trajs, n_draws=1, seed=0)
    b = score_turns(model, [t.to_dict() for t in trajs], n_draws=1, seed=0)
    assert torch.equal(a.per_turn, b.per_turn)
    bad = trajs[0].to_dict()
    bad["generated"] = bad["generated"][:-1]
    with pytest.raises(ValueError, match="differ in length"):
        score_turns(model, [bad])
    with pytest.raises(ValueError, match="no trajectories"):
        score_turns(model, [])


K, MASK, PAD = 4, 2, 1


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                          moe_intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                                          block_size=K, initializer_range=0.2))
    return m.eval()


def _layout(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return layout_segments([(torch.randint(3, 100, (n,), generator=g).tolist(), gen) for n, gen in lengths], K, 7)


ROWS = [[(3, False), (5, True), (2, False), (4, True)],  # two turns, ends on a block boundary
        [(6, False), (3, True)],                          # one turn, shorter
        [(5, False)]]                                     # a prompt only: no model turn


def _reference(model, ids, masked, weight, start, end):
    """One turn by hand (float64 log-probabilities): each block of [start, end) with a masked token scored by its
    own forward over the clean tokens before it and the block with its masked tokens replaced."""
    total = torch.zeros((), dtype=torch.float64)
    x = torch.tensor(ids)
    for b0 in range(start - start % K, end, K):
        m = masked[b0:b0 + K].clone()
        m[: max(0, start - b0)] = False
        if not m.any():
            continue
        block = x[b0:b0 + K].clone()
        block[m] = MASK
        with torch.no_grad():
            logp = model(torch.cat([x[:b0], block])[None]).logits[0, b0:].double().log_softmax(-1)
        for j in m.nonzero().flatten().tolist():
            total += logp[j, x[b0 + j]] * float(weight[b0 + j])
    return total


def _turns(lay):
    """[(start, end)] of each model turn of a layout (its generated segments, filler included)."""
    out, s = [], None
    for p, (g, seg) in enumerate(zip(lay.generated + [False], lay.segment + [-2])):
        if g and s is None:
            s = p
        if s is not None and (not g or seg != lay.segment[s]):
            out.append((s, p))
            s = p if g else None
    return out


def test_trajectory_tensors_pad_rows_to_whole_blocks_as_documented():
    lays = [_layout(i, r) for i, r in enumerate(ROWS)]
    ids, gen, seg = trajectory_tensors(lays, K, 9)
    L = -(-max(len(x.ids) for x in lays) // K) * K
    assert ids.shape == gen.shape == seg.shape == (3, L) and ids.dtype == seg.dtype == torch.long
    assert gen.dtype == torch.bool
    for i, x in enumerate(lays):
        n = len(x.ids)
        assert ids[i].tolist() == x.ids + [9] * (L - n) and gen[i].tolist() == x.generated + [False] * (L - n)
        assert seg[i].tolist() == x.segment + [-1] * (L - n)


def test_bad_batches_are_refused_naming_the_row_and_lengths(model):
    good = _layout(0, ROWS[0]).__dict__
    bad = dict(good, segment=good["segment"][:-1])
    n = len(good["ids"])
    msg = rf"^score_turns: row 1: ids, generated and segment differ in length \({n}, {n}, {n - 1}\)$"
    with pytest.raises(ValueError, match=msg):
        trajectory_tensors([good, bad], K, PAD)
    with pytest.raises(ValueError, match="^score_turns: no trajectories$"):
        score_turns(model, [])


def test_score_turns_matches_a_per_turn_per_block_loop_on_hand_laid_turns(model):
    lays = [_layout(i, r) for i, r in enumerate(ROWS)]
    s = score_turns(model, lays, n_draws=3, t_min=0.3, t_max=0.7, seed=5)
    ids, gen, seg = trajectory_tensors(lays, K, PAD)
    want = draw_noise(turn_response_mask(gen, seg, K), K, 3, 0.3, 0.7, torch.Generator().manual_seed(5))
    assert torch.equal(s.noise.masked, want.masked) and torch.equal(s.noise.weight, want.weight)
    assert s.per_turn.shape == (3, 3, 2) and s.composite.shape == (3, 3)
    assert s.n_turns.tolist() == [2, 1, 0] and s.n_turns.dtype == torch.long
    for i, lay in enumerate(lays):
        turns = _turns(lay)
        assert len(turns) == s.n_turns[i]
        for n in range(3):
            for t in range(2):
                if t >= len(turns):
                    assert s.per_turn[i, n, t] == 0
                    continue
                ref = _reference(model, lay.ids, s.noise.masked[n, i], s.noise.weight[n, i], *turns[t])
                # fp32 forward against a float64 sum of < 20 terms of size < 50 (log-prob ~5 x weight <= 1/0.3)
                assert abs(float(s.per_turn[i, n, t]) - float(ref)) < 1e-3, (i, n, t)
            assert abs(float(s.composite[i, n]) - float(s.per_turn[i, n].sum())) < 1e-4
    assert torch.equal(s.mean(), s.per_turn.mean(1))


def test_defaults_seed_generator_and_dicts(model):
    lays = [_layout(i, r) for i, r in enumerate(ROWS[:2])]
    a = score_turns(model, lays)
    b = score_turns(model, [x.__dict__ for x in lays], n_draws=4, t_min=0.1, t_max=1.0, seed=0)
    assert torch.equal(a.per_turn, b.per_turn) and a.per_turn.shape[1] == 4
    ids, gen, seg = trajectory_tensors(lays, K, PAD)
    want = draw_noise(turn_response_mask(gen, seg, K), K, 4, 0.1, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(a.noise.masked, want.masked) and torch.equal(a.noise.t, want.t)
    c = score_turns(model, lays, seed=0, generator=torch.Generator().manual_seed(11))
    d = score_turns(model, lays, seed=11)
    assert torch.equal(c.per_turn, d.per_turn) and not torch.equal(c.noise.masked, a.noise.masked)


def test_rows_without_turns_have_one_zero_column(model):
    s = score_turns(model, [_layout(0, ROWS[2]), _layout(1, [(3, False), (2, False)])], n_draws=2)
    assert s.per_turn.shape == (2, 2, 1) and (s.per_turn == 0).all() and s.n_turns.tolist() == [0, 0]
    one = score_turns(model, [_layout(0, ROWS[1])], n_draws=2)
    assert one.per_turn.shape == (1, 2, 1) and one.n_turns.tolist() == [1]


def test_the_model_s_pad_id_pads_or_the_mask_id_without_one(model):
    """A row whose last turn ends inside a block (laid out without pad_last) shares that block with the batch's
    padding, which its tokens see: the pad id is visible in its score. Scored alone, padded by hand with the pad
    id the docstring names, it must score the same."""
    short = layout_segments([([5, 6, 7], False), ([8, 9], True)], K, 7, pad_last=False)  # 5 tokens: ends mid-block
    long_ = _layout(3, ROWS[0])
    old = model.config.pad_token_id
    try:
        for pad in (PAD, None):
            model.config.pad_token_id = pad
            both = score_turns(model, [short, long_], n_draws=2, seed=1)
            fill = MASK if pad is None else PAD
            L = both.noise.masked.shape[-1]
            padded = dict(ids=short.ids + [fill] * (L - 5), generated=short.generated + [False] * (L - 5),
                          segment=short.segment + [-1] * (L - 5))
            alone = score_turns(model, [padded, long_], n_draws=2, seed=1)  # already padded: nothing added
            assert torch.equal(both.per_turn, alone.per_turn), pad
            other = dict(padded, ids=short.ids + [fill + 40] * (L - 5))
            assert not torch.equal(score_turns(model, [other, long_], n_draws=2, seed=1).per_turn[0],
                                   both.per_turn[0])  # the padding is visible: the check above can tell
    finally:
        model.config.pad_token_id = old


def test_a_turn_sharing_a_block_with_what_follows_it_is_refused(model):
    """Step 2 of the recipe: a block holding a model turn and anything after it would let the turn see its
    future; score_turns refuses it rather than scoring it."""
    leaky = layout_segments([([5, 6, 7], False), ([8, 9], True), ([10, 11], False)], 1, 7)  # no block alignment
    with pytest.raises(ValueError, match="later segment"):
        score_turns(model, [leaky])
