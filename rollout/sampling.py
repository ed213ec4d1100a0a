"""Step 1 of draft-and-edit decoding: each position's candidate token and its confidence.

`candidates` uses the fused `kernels.decode.candidates` when that package imports and falls back to
`candidates_reference`, a plain-torch version kept here so the decoder works without `kernels`.
Semantics (docs/background.md section 3, step 1), identical in both:

- penalty first: subtract `penalty` from the logit of token suppress[b, k] at position (b, k);
- temperature 0: tok = argmax, prob = softmax(logits)[tok];
- temperature > 0: logits / T, then top-k, then top-p filtering; tok drawn by Gumbel-max with fp32
  noise from row b's own generator (so a row's draws never depend on its batch neighbours), and prob is
  tok's probability under that filtered, tempered distribution (the one it was drawn from).
"""
from __future__ import annotations

import torch

try:  # the fused kernel package is optional: its torch path is exact, Triton is used on CUDA
    from kernels.decode import candidates as _kernel_candidates
except ImportError:  # pragma: no cover - depends on the installation
    _kernel_candidates = None


def filter_top_k_top_p(x: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus filtering of fp32 logits (..., V): dropped entries become -inf.

    top-k keeps every token whose logit is >= the k-th largest (ties kept); top-p keeps the most likely
    tokens until their mass reaches top_p (a token is dropped when the mass strictly before it already
    reaches top_p; the most likely token always stays).
    """
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=True)
        p = srt.softmax(-1)
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        drop_sorted[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted), float("-inf"))
    return x


def gumbel_noise(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """Standard Gumbel noise (fp32) drawn from `generator` on its own device, then moved to `device`."""
    gdev = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, device=gdev, dtype=torch.float32).to(device)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))


def candidates_reference(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         generators=None, suppress: torch.Tensor | None = None, penalty: float = 0.0):
    """Plain-torch candidates: logits (B, K, V) -> tok (B, K) long, prob (B, K) fp32 (see module doc)."""
    x = logits.float()
    if suppress is not None and penalty:
        valid = (suppress >= 0).to(x.dtype)
        x = x.scatter_add(-1, suppress.clamp_min(0).long()[..., None], (-penalty * valid)[..., None])
    if temperature == 0:
        tok = x.argmax(-1)
    else:
        x = filter_top_k_top_p(x / temperature, top_k, top_p)
        gens = generators if generators is not None else [None] * x.shape[0]
        tok = torch.stack([(x[b] + gumbel_noise(x.shape[1:], gens[b], x.device)).argmax(-1)
                           for b in range(x.shape[0])])
    prob = (x.gather(-1, tok[..., None]).squeeze(-1) - torch.logsumexp(x, -1)).exp()
    return tok, prob


def candidates(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generators=None, suppress: torch.Tensor | None = None, penalty: float = 0.0,
               use_kernel: bool = True):
    """Candidate token and probability per position: (B, K, V) -> (B, K) long, (B, K) fp32.

    Uses `kernels.decode.candidates` when available (and `use_kernel`), else `candidates_reference`.
    """
    if use_kernel and _kernel_candidates is not None:
        return _kernel_candidates(logits, temperature, top_k, top_p, generators, suppress, penalty)
    return candidates_reference(logits, temperature, top_k, top_p, generators, suppress, penalty)


def candidates_at_temperatures(logits: torch.Tensor, temperatures: list[float], top_k: int = 0, top_p: float = 1.0,
                               generators=None, suppress: torch.Tensor | None = None, penalty: float = 0.0):
    """`candidates` for sampled rows each at its own temperature (all > 0): logits (B, K, V), temperatures (B,).

    The penalty is applied first and each row is divided by its temperature, then sampled at temperature 1 (a
    division by 1 is exact), so row b gets what `candidates` at temperatures[b] gives it alone."""
    if min(temperatures) <= 0:
        raise ValueError("candidates_at_temperatures: every temperature must be > 0 (greedy rows go to candidates)")
    x = logits.float()
    if suppress is not None and penalty:
        valid = (suppress >= 0).to(x.dtype)
        x = x.scatter_add(-1, suppress.clamp_min(0).long()[..., None], (-penalty * valid)[..., None])
    t = torch.tensor(temperatures, dtype=x.dtype, device=x.device)[:, None, None]
    return candidates(x / t, 1.0, top_k, top_p, generators)


def kernel_available() -> bool:
    """True when the fused `kernels.decode.candidates` is importable."""
    return _kernel_candidates is not None
