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


def test_chunked_module_head_equals_one_shot(monkeypatch):
    whole = _run(monkeypatch, 10_000)
    chunked = _run(monkeypatch, 5)
    for a, b in zip(whole[:3], chunked[:3]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    # one shot keeps the (23, 50) fp32 log-softmax; the chunks keep only their input rows
    assert whole[3] >= 23 * 50 * 4
    assert chunked[3] < 23 * 50 * 4 / 2
