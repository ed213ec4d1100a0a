"""The Multi-Block Editing window term against a plain per-example computation with a hand-built mask."""
import torch
import torch.nn.functional as F

from ebpo.core.mbe_objective import mbe_window_loss, mbe_window_mask
from ebpo.core.noise import substitution_ids, t2t_substitute
from ebpo.model import LLaDA2MoeModelLM, tiny_config


def plain_keep(L, K, W, shift):
    """keep[i][j]: j's enlarged block (of (W+1)K tokens, boundaries shifted by `shift` K-blocks) <= i's."""
    blk = [(p + shift * K) // ((W + 1) * K) for p in range(L)]
    return torch.tensor([[blk[j] <= blk[i] for j in range(L)] for i in range(L)])


def test_window_mask_is_enlarged_block_causal_at_every_shift():
    for W in (1, 2):
        for shift in range(W + 1):
            assert torch.equal(mbe_window_mask(12, 2, W, shift)[0, 0], plain_keep(12, 2, W, shift)), (W, shift)
    # W = 1, K = 2, shift 0: position 0 sees the next block (positions 2, 3) but not position 4
    m = mbe_window_mask(8, 2, 1, 0)[0, 0]
    assert m[0, 3] and not m[0, 4] and m[4, 0]


def test_mbe_loss_equals_a_plain_computation():
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, block_size=2)).eval()
    clean = torch.randint(8, 60, (3, 10))
    resp = torch.zeros(3, 10, dtype=torch.bool)
    resp[:, 3:] = True
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    loss, m = mbe_window_loss(model, model.lm_head, clean, resp, block_size=2, window=1, rate=0.4, keep_weight=0.5,
                              allowed_ids=allowed, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)  # the same draws, in the same order
    shift = int(torch.randint(0, 2, (1,), generator=g))
    noisy, sub = t2t_substitute(clean, resp, 0.4, allowed, g)
    assert m["mbe/shift"] == shift and sub.any()
    keep = plain_keep(10, 2, 1, shift)
    restore, kept = [], []
    for i in range(3):
        logits = model(noisy[i:i + 1], attention_mask=keep[None, None], position_ids=torch.arange(10)).logits[0]
        ce = F.cross_entropy(logits.float(), clean[i], reduction="none")
        restore += ce[sub[i]].tolist()
        kept += ce[resp[i] & ~sub[i]].tolist()
    want = sum(restore) / len(restore) + 0.5 * sum(kept) / len(kept)
    assert abs(float(loss) - want) < 1e-4, (float(loss), want)


def test_mbe_loss_draws_its_shift_on_the_generators_device_whatever_the_default_device():
    """The shift is drawn with the caller's generator on that generator's device: a run whose default device is
    another one (here `meta`, which has no generator at all) gives the same loss as one on the CPU default."""
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, block_size=2)).eval()
    clean = torch.randint(8, 60, (2, 8))
    resp = torch.zeros(2, 8, dtype=torch.bool)
    resp[:, 2:] = True
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    kw = dict(block_size=2, window=1, rate=0.4, keep_weight=0.5, allowed_ids=allowed)
    want, m_want = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator().manual_seed(3), **kw)
    with torch.device("meta"):
        got, m_got = mbe_window_loss(model, model.lm_head, clean, resp, generator=torch.Generator("cpu").manual_seed(3),
                                     **kw)
    assert got.device.type == "cpu" and m_got["mbe/shift"] == m_want["mbe/shift"]
    assert float(got) == float(want)
