"""CPU tests of `kernels.decode.candidates` (torch path) against plain references."""
import pytest
import torch

from kernels.decode import candidates, filter_logits


def ref_penalise(logits, suppress, penalty):
    x = logits.float().clone()
    for b in range(x.shape[0]):
        for k in range(x.shape[1]):
            if suppress[b, k] >= 0:
                x[b, k, suppress[b, k]] -= penalty
    return x


def test_greedy_is_softmax_then_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 200, generator=g) * 4
    logits[0, 0, 7] = logits[0, 0, 9] = 50.0  # tie: first index wins, as torch.argmax
    tok, prob = candidates(logits)
    p = torch.softmax(logits.double(), -1)
    assert torch.equal(tok, p.argmax(-1))
    torch.testing.assert_close(prob.double(), p.max(-1).values, rtol=1e-5, atol=1e-6)
    assert tok[0, 0] == 7 and prob.dtype == torch.float32
    tok16, prob16 = candidates(logits.bfloat16())
    assert torch.equal(tok16, logits.bfloat16().float().argmax(-1))


def test_penalty_applied_before_everything():
    logits = torch.randn(2, 4, 50)
    logits[:, :, 3] = 10.0
    sup = torch.tensor([[3, -1, 3, 0], [-1, 3, -1, -1]])
    tok, prob = candidates(logits, suppress=sup, penalty=30.0)
    x = ref_penalise(logits, sup, 30.0)
    assert torch.equal(tok, x.argmax(-1))
    torch.testing.assert_close(prob, torch.softmax(x, -1).max(-1).values)
    assert tok[0, 1] == 3 and tok[0, 0] != 3
    t2, p2 = candidates(logits, temperature=0.8, generators=[torch.Generator().manual_seed(i) for i in range(2)],
                        suppress=sup, penalty=1e4)
    assert not (t2[0, 0] == 3 or t2[0, 2] == 3 or t2[1, 1] == 3)


def ref_top_p(x, top_p):
    """Plain loop nucleus: keep the most likely tokens until their mass reaches top_p."""
    out = torch.full_like(x, float("-inf"))
    for r in range(x.shape[0]):
        p = torch.softmax(x[r], -1)
        mass = 0.0
        for i in torch.argsort(p, descending=True).tolist():
            out[r, i] = x[r, i]
            mass += p[i].item()
            if mass >= top_p:
                break
    return out


def test_filters_match_plain_loops():
    x = torch.randn(6, 30)
    torch.testing.assert_close(filter_logits(x, top_p=0.7), ref_top_p(x, 0.7))
    kept = filter_logits(x, top_k=4)
    for r in range(6):
        assert set(torch.nonzero(torch.isfinite(kept[r])).flatten().tolist()) == set(x[r].topk(4).indices.tolist())


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_sampling_reproducible_and_row_independent():
    logits = torch.randn(3, 8, 100)
    a = candidates(logits, temperature=1.0, generators=gens([1, 2, 3]))
    b = candidates(logits, temperature=1.0, generators=gens([1, 2, 3]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # row 1 alone with the same generator draws the same tokens as inside the batch
    c = candidates(logits[1:2], temperature=1.0, generators=gens([2]))
    assert torch.equal(c[0][0], a[0][1])
    d = candidates(logits, temperature=1.0, generators=gens([7, 8, 9]))
    assert not torch.equal(d[0], a[0])


@pytest.mark.parametrize("temp,top_k,top_p", [(0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6)])
def test_sampling_distribution_and_prob(temp, top_k, top_p):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1, 1, 6, generator=g) * 1.5
    K = 4000  # many positions share the same logits: one call gives K independent draws
    logits = base.expand(1, K, 6).contiguous()
    tok, prob = candidates(logits, temperature=temp, top_k=top_k, top_p=top_p, generators=gens([11]))
    # reference distribution: temper, filter by plain code, softmax
    x = base[0, 0] / temp
    if top_k:
        x = torch.where(x >= x.topk(top_k).values[-1], x, torch.tensor(float("-inf")))
    if top_p < 1.0:
        x = ref_top_p(x[None], top_p)[0]
    p = torch.softmax(x, -1)
    torch.testing.assert_close(prob[0], p[tok[0]])
    freq = torch.bincount(tok[0], minlength=6).float() / K
    assert (p[freq > 0] > 0).all()  # never a filtered token
    assert (freq - p).abs().max() < 4 * (0.25 / K) ** 0.5 + 1e-3  # ~4 sigma binomial band


def test_bad_input_messages():
    with pytest.raises(ValueError, match="logits"):
        candidates(torch.randn(3, 4))
    with pytest.raises(ValueError, match="generators"):
        candidates(torch.randn(2, 3, 4), temperature=1.0, generators=gens([1]))
    with pytest.raises(ValueError, match="top_p"):
        candidates(torch.randn(2, 3, 4), temperature=1.0, top_p=0.0)
