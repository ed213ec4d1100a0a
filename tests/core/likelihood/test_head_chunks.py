"""The LM head through its module (the ZeRO-3 path) in checkpointed row chunks gives the log-probs and
gradients of the one-shot computation, and keeps only the chunks' input rows for the backward."""
import torch

import ebpo.core.likelihood as lik
from ebpo.infra.memory_plan import saved_tensor_bytes


class _Model(torch.nn.Module):
    def __init__(self, H=16, V=50):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.head = torch.nn.Linear(H, V, bias=False)

    def get_output_embeddings(self):
        return self.head


def _run(monkeypatch, chunk):
    monkeypatch.setattr(lik, "MODULE_HEAD_CHUNK", chunk)
    model = _Model()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=g)
    lp = lik.gathered_logprobs(model, hidden, targets, use_module_head=True)
    saved = saved_tensor_bytes(lambda: lik.gathered_logprobs(model, hidden, targets, use_module_head=True))
    (lp * torch.arange(23.0)).sum().backward()
    return lp.detach(), hidden.grad, model.head.weight.grad, saved


U, LAMBDA = torch.finfo(torch.float32).eps / 2, 8.0  # fp32 unit roundoff; probabilistic rounding bound: a sum
# of n terms is off by at most LAMBDA * sqrt(n) * U * sum|terms| but with probability ~3e-14 (Higham & Mary 2019)


def _error_bounds():
    """Elementwise bounds on the rounding error of (log-probs, hidden.grad, head.weight.grad) of _run, from the
    computation: logits are sums of H terms, the log-softmax and the hidden gradient sums of V, the weight
    gradient a sum over the T rows (in any chunking); each bounded with this input's magnitudes, the logits'
    error carried to first order into the softmax. Two evaluations differ by at most twice these."""
    model, g = _Model(), torch.Generator().manual_seed(1)
    h = torch.randn(23, 16, generator=g)
    targets = torch.randint(0, 50, (23,), generator=g)
    W = model.head.weight.detach()
    (T, H), V = h.shape, W.shape[0]
    z = h @ W.t()
    e_z = LAMBDA * H ** 0.5 * U * (h.abs() @ W.abs().t())  # (T, V)
    p = torch.softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    e_lp = e_z.gather(1, targets[:, None])[:, 0] + e_z.max(-1).values + LAMBDA * V ** 0.5 * U * (1 + lse.abs())
    c = torch.arange(23.0)[:, None]
    dz = c * (torch.nn.functional.one_hot(targets, V) - p)
    e_dz = c * p * (2 * e_z.max(-1, keepdim=True).values + LAMBDA * V ** 0.5 * U)  # softmax from erring logits
    e_hgrad = LAMBDA * V ** 0.5 * U * (dz.abs() @ W.abs()) + e_dz @ W.abs()
    e_wgrad = LAMBDA * T ** 0.5 * U * (dz.abs().t() @ h.abs()) + e_dz.t() @ h.abs()
    return e_lp, e_hgrad, e_wgrad


def test_chunked_module_head_equals_one_shot(monkeypatch):
    whole = _run(monkeypatch, 10_000)
    chunked = _run(monkeypatch, 5)
    for a, b, bound in zip(whole[:3], chunked[:3], _error_bounds()):
        # chunks change which GEMM kernels run and the order of the weight gradient's sum: within rounding
        assert ((a - b).abs() <= 2 * bound).all(), ((a - b).abs() / bound).max()
    # one shot keeps the (23, 50) fp32 log-softmax; the chunks keep only their input rows
    assert whole[3] >= 23 * 50 * 4
    assert chunked[3] < 23 * 50 * 4 / 2
