"""Rules of the MBE window term that the plain-computation test leaves open (issue 40): every metric against a
per-example reference, the shift's range (every s in 0..W occurs, nothing outside it), `keep_weight` scaling
only the keep term, and a batch without substitutions (restore and its accuracy are 0, the keep term stays)."""
import torch
import torch.nn.functional as F

from ebpo.core.mbe_objective import mbe_window_loss
from ebpo.core.noise import substitution_ids, t2t_substitute
from ebpo.model import LLaDA2MoeModelLM, tiny_config


def _model():
    torch.manual_seed(0)
    return LLaDA2MoeModelLM(tiny_config(num_hidden_layers=1, block_size=2)).eval()


def _reference(model, clean, resp, K, W, rate, allowed, seed):
    """(restore mean CE, keep mean CE, restore accuracy, shift) drawn as the docstring says, one row at a time."""
    g = torch.Generator().manual_seed(seed)
    shift = int(torch.randint(0, W + 1, (1,), generator=g))
    noisy, sub = t2t_substitute(clean, resp, rate, allowed, g)
    L = clean.shape[1]
    blk = [(p + shift * K) // ((W + 1) * K) for p in range(L)]
    keep = torch.tensor([[blk[j] <= blk[i] for j in range(L)] for i in range(L)])
    restore, kept, hit = [], [], []
    for i in range(clean.shape[0]):
        logits = model(noisy[i:i + 1], attention_mask=keep[None, None], position_ids=torch.arange(L)).logits[0]
        ce = F.cross_entropy(logits.float(), clean[i], reduction="none")
        restore += ce[sub[i]].tolist()
        kept += ce[resp[i] & ~sub[i]].tolist()
        hit += (logits.argmax(-1) == clean[i])[sub[i]].tolist()
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return mean(restore), mean(kept), mean([float(h) for h in hit]), shift


def test_mbe_metrics_shift_and_keep_weight_match_the_reference():
    model = _model()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.randint(8, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    resp = torch.zeros(2, 12, dtype=torch.bool)
    resp[:, 2:] = True
    W, shifts = 2, set()
    for seed in range(4):  # seeds 0..3 draw the shifts 2, 1, 0, 1
        kw = 0.5 * (seed % 2)
        loss, m = mbe_window_loss(model, model.lm_head, clean, resp, block_size=2, window=W, rate=0.5,
                                  keep_weight=kw, allowed_ids=allowed, generator=torch.Generator().manual_seed(seed))
        r, k, acc, shift = _reference(model, clean, resp, 2, W, 0.5, allowed, seed)
        # fp32 CE of a 1-layer model over < 24 tokens: sums of O(10) terms, a few fp32 ulps of O(5)
        assert abs(m["loss/mbe_restore"] - r) < 1e-4 and abs(m["loss/mbe_keep"] - k) < 1e-4, seed
        assert abs(m["acc/mbe_restore"] - acc) < 1e-6 and m["mbe/shift"] == shift, seed
        assert abs(float(loss) - (r + kw * k)) < 1e-4, (seed, kw)
        shifts.add(shift)
    assert shifts == set(range(W + 1))  # every shift of 0..W drawn by these fixed seeds


def test_without_substitutions_only_the_keep_term_counts():
    model = _model()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.randint(8, 60, (2, 8), generator=torch.Generator().manual_seed(4))
    resp = torch.zeros(2, 8, dtype=torch.bool)
    resp[:, 3:] = True
    loss, m = mbe_window_loss(model, model.lm_head, clean, resp, block_size=2, window=1, rate=0.0, keep_weight=0.25,
                              allowed_ids=allowed, generator=torch.Generator().manual_seed(0))
    r, k, acc, _ = _reference(model, clean, resp, 2, 1, 0.0, allowed, 0)
    assert r == 0.0 and m["loss/mbe_restore"] == 0.0 and m["acc/mbe_restore"] == 0.0
    assert abs(m["loss/mbe_keep"] - k) < 1e-4 and abs(float(loss) - 0.25 * k) < 1e-4
    loss.backward()  # the empty restore term keeps the graph alive


def test_restore_accuracy_counts_the_head_s_hits():
    """acc/mbe_restore is the fraction of substituted positions where the head's argmax is the clean token: a
    head that always prefers the (single) clean token scores 1, one that prefers another token 0."""
    model = _model()
    allowed = substitution_ids(model.config.vocab_size, [0, 2])
    clean = torch.full((2, 8), 9)
    resp = torch.zeros(2, 8, dtype=torch.bool)
    resp[:, 2:] = True
    for tok, want in [(9, 1.0), (10, 0.0)]:
        bias = torch.zeros(model.config.vocab_size)
        bias[tok] = 50.0
        _, m = mbe_window_loss(model, lambda h, b=bias: model.lm_head(h) + b, clean, resp, block_size=2, window=1,
                               rate=0.5, keep_weight=0.5, allowed_ids=allowed, generator=torch.Generator().manual_seed(1))
        assert m["acc/mbe_restore"] == want, tok
