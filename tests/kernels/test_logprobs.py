"""CPU tests of chunked token log-probs against full-logits log_softmax, values and gradients."""
import pytest
import torch

from kernels.logprobs import token_logprobs


def full_reference(h, w, t, b=None):
    logits = (h @ w.t()).double()
    if b is not None:
        logits = logits + b.double()
    return torch.log_softmax(logits, -1)[torch.arange(h.shape[0]), t]


@pytest.mark.parametrize("chunk,bias", [(5, False), (16, True), (4096, False), (1, True)])
def test_values_and_grads_match_full_logits(chunk, bias):
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 37, 24, 301
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    up = torch.randn(N, generator=g, dtype=torch.float64)
    out = token_logprobs(h, w, t, chunk_size=chunk, bias=b)
    assert out.shape == (N,) and out.dtype == torch.float32
    grads = torch.autograd.grad((out * up).sum(), [h, w] + ([b] if bias else []))
    ref = full_reference(h, w, t, b)
    rgrads = torch.autograd.grad((ref * up).sum(), [h, w] + ([b] if bias else []))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, rgrads):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_bf16_weight_and_partial_grads():
    torch.manual_seed(0)
    N, H, V = 20, 32, 97
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H).bfloat16()  # frozen head: only d hidden
    t = torch.randint(0, V, (N,))
    out = token_logprobs(h, w, t, chunk_size=6)
    out.sum().backward()
    hr = h.detach().clone().requires_grad_()
    ref = torch.log_softmax((hr.bfloat16() @ w.t()).float(), -1)[torch.arange(N), t]
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h.grad, hr.grad, rtol=2e-2, atol=2e-2)


def test_gradcheck_double():
    torch.manual_seed(1)
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 9, (6,))
    # fp32 softmax inside: compare against finite differences at fp32-level tolerance
    assert torch.autograd.gradcheck(lambda a, b: token_logprobs(a, b, t, chunk_size=4).double(), (h, w),
                                    eps=1e-3, atol=2e-3, rtol=2e-3)


def test_bad_input():
    with pytest.raises(ValueError, match="targets must lie"):
        token_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="weight"):
        token_logprobs(torch.randn(3, 4), torch.randn(5, 3), torch.tensor([0, 1, 1]))
