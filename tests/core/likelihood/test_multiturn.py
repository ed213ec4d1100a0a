"""Multi-turn composites: no turn sees its future, and each turn agrees with a per-turn reference loop.

Turns are laid out by `ebpo.core.turns.layout_segments` (every model turn padded to a block boundary);
the composite is the ordinary one on the generated-token mask (`turn_response_mask`)."""
import pytest
import torch

from ebpo.core.likelihood import all_composites, draw_noise, per_turn_composites, turn_response_mask
from ebpo.core.turns import layout_segments, leaking_blocks, turn_index
from ebpo.model import LLaDA2MoeModelLM
from ebpo.model.presets import tiny_config

K, MASK, FILL = 4, 2, 1
LENGTHS = [(5, False), (6, True), (3, False), (5, True), (4, False), (3, True)]  # prompt, turn, obs, turn, obs, turn


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                          block_size=K, initializer_range=0.2))
    return m.eval()


def segments(seed, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 128, (n,), generator=g).tolist(), gen) for n, gen in lengths]


def batch(segs_list, block_size=K):
    """Right-padded (ids, generated, segment) of laid-out rows, padded to a common whole number of blocks."""
    lays = [layout_segments(s, block_size, FILL) for s in segs_list]
    L = -(-max(len(x.ids) for x in lays) // K) * K
    ids = torch.full((len(lays), L), FILL)
    gen = torch.zeros(len(lays), L, dtype=torch.bool)
    seg = torch.full((len(lays), L), -1)
    for i, x in enumerate(lays):
        ids[i, :len(x.ids)], gen[i, :len(x.ids)], seg[i, :len(x.ids)] = (torch.tensor(x.ids), torch.tensor(x.generated),
                                                                         torch.tensor(x.segment))
    return ids, gen, seg


def turn_composites(model, ids, gen, seg, n_draws=3, seed=1):
    resp = turn_response_mask(gen, seg, K)
    nz = draw_noise(resp, K, n_draws, 0.1, 1.0, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        comp, blocks = all_composites(model, ids, nz, MASK, return_blocks=True)
    per_turn = per_turn_composites(blocks, turn_index(gen, seg), K, 3)
    assert torch.allclose(per_turn.sum(-1), comp, atol=1e-4)
    return per_turn, nz


def test_layout_pads_every_model_turn_to_a_block_boundary():
    lay = layout_segments(segments(0), K, FILL)
    ids, gen, seg = (t[None] for t in lay.tensors())
    for s in range(len(LENGTHS) - 1):
        if LENGTHS[s][1]:  # a model turn: the next segment starts a block
            assert (seg[0] == s + 1).nonzero()[0].item() % K == 0
    assert not leaking_blocks(gen, seg, K).any()
    assert turn_index(gen, seg)[0].max().item() == 2
    fill = torch.tensor(lay.filler)
    assert (ids[0][fill] == FILL).all() and gen[0][fill].all() and len(lay.ids) % K == 0
    # unaligned (block size 1 lays out nothing): the same tokens in blocks of K leak
    raw = layout_segments(segments(0), 1, FILL)
    ids_r, gen_r, seg_r = (t[None] for t in raw.tensors())
    assert leaking_blocks(gen_r, seg_r, K).any()
    with pytest.raises(ValueError, match="later segment"):
        turn_response_mask(gen_r, seg_r, K)


def test_turn_composite_does_not_change_when_the_future_changes(model):
    base = segments(0)
    ids, gen, seg = batch([base])
    ref, _ = turn_composites(model, ids, gen, seg)
    for t, seg_idx in enumerate([1, 3]):  # turns 0 and 1: change every segment after them
        for variant in range(3):
            changed = base[: seg_idx + 1] + segments(100 + variant)[seg_idx + 1:]
            ids2, gen2, seg2 = batch([changed])
            assert ids2.shape == ids.shape and torch.equal(ids2[seg2 <= seg_idx], ids[seg <= seg_idx])
            assert not torch.equal(ids2, ids)
            got, _ = turn_composites(model, ids2, gen2, seg2)
            assert torch.allclose(got[..., : t + 1], ref[..., : t + 1], atol=1e-5), (t, variant)
            assert not torch.allclose(got[..., t + 1:], ref[..., t + 1:], atol=1e-5)  # the future did change


def test_unaligned_turns_would_leak(model):
    """The check above fails without the alignment: turn 0 then sees the observation after it."""
    base = segments(0)
    ids, gen, seg = (t[None] for t in layout_segments(base, 1, FILL).tensors())
    changed = base[:2] + segments(100)[2:]
    ids2, _, _ = (t[None] for t in layout_segments(changed, 1, FILL).tensors())
    resp = gen  # bypass turn_response_mask, which refuses this layout
    L = -(-ids.shape[1] // K) * K
    pad = lambda x, v: torch.nn.functional.pad(x, (0, L - x.shape[1]), value=v)
    nz = draw_noise(pad(resp, False), K, 3, 0.1, 1.0, torch.Generator().manual_seed(1))
    t0 = pad(turn_index(gen, seg), -1)
    with torch.no_grad():
        a = per_turn_composites(all_composites(model, pad(ids, FILL), nz, MASK, return_blocks=True)[1], t0, K, 3)
        b = per_turn_composites(all_composites(model, pad(ids2, FILL), nz, MASK, return_blocks=True)[1], t0, K, 3)
    assert not torch.allclose(a[..., 0], b[..., 0], atol=1e-5)


def reference_turn(model, ids, masked, weight, t_end):
    """Plain loop over one turn: the sequence cut at the turn's end, each block b of the turn scored by its
    own forward over [clean tokens before b ; noisy block b], full logits, float64."""
    total = torch.zeros((), dtype=torch.float64)
    x = ids[:t_end]
    for b0 in range(0, t_end, K):
        m = masked[b0:b0 + K]
        if not m.any():
            continue
        block = x[b0:b0 + K].clone()
        block[m] = MASK
        logp = model(torch.cat([x[:b0], block])[None]).logits[0, b0:].double().log_softmax(-1)
        for j in m.nonzero().flatten().tolist():
            total += logp[j, x[b0 + j]] * float(weight[b0 + j])
    return total


def test_turn_composites_match_a_per_turn_reference(model):
    ids, gen, seg = batch([segments(0), segments(7, [(3, False), (9, True), (6, False), (2, True), (1, False),
                                                    (7, True)])])
    per_turn, nz = turn_composites(model, ids, gen, seg, n_draws=2)
    turns = turn_index(gen, seg)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            for t in range(3):
                pos = (turns[i] == t).nonzero().flatten()
                t_end = int(pos.max()) + 1
                assert t_end % K == 0, "a turn ends on a block boundary"
                for n in range(2):
                    own = nz.masked[n, i] & (turns[i] == t)  # only this turn's tokens are scored
                    ref = reference_turn(model, ids[i], own, nz.weight[n, i], t_end)
                    assert torch.allclose(per_turn[i, n, t].double(), ref, atol=1e-4), (i, t, n)
