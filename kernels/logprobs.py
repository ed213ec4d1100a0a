"""Memory-light token log-probs for the learner: log p(target) from final hidden states and the LM head.

    token_logprobs(hidden (N, H), weight (V, H), targets (N,)) -> (N,) fp32
    = log_softmax(hidden @ weight^T + bias, fp32)[n, targets[n]]

The rows are processed `chunk_size` at a time, forward and backward, so at most a (chunk, V) fp32 block of
logits exists at once instead of (N, V): at LLaDA2's vocabulary 157184 and 32k scored tokens the full
fp32 logits alone would be ~20 GB. The backward recomputes each chunk's logits (one extra matmul) and
writes d hidden and accumulates d weight (fp32) chunk by chunk; only the (N,) log-sum-exp is saved.
The matmuls are cuBLAS/CPU BLAS in the weight's dtype (bf16 on GPU); softmax arithmetic is fp32.
"""
from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # matmul in the compute dtype, then one fp32 copy (in place bias add: no extra (chunk, V) buffer)
    logits = (h.to(weight.dtype) @ weight.t()).float()
    if bias is not None:
        logits += bias.float()
    return logits


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        N = hidden.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            logits = _chunk_logits(hidden[s:e], weight, bias)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            out[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        grad_out = grad_out.float()
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            h = hidden[s:e]
            # d out / d logits = onehot(target) - softmax; times the incoming grad g: (onehot - p) * g
            g = grad_out[s:e]
            dlog = _chunk_logits(h, weight, bias)
            dlog.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
            dlog.scatter_add_(1, targets[s:e, None], g[:, None])
            if need_b:
                grad_b += dlog.sum(0)
            dl = dlog.to(weight.dtype)
            del dlog
            if need_h:
                grad_h[s:e] = (dl @ weight).to(hidden.dtype)
            if need_w:
                # fp32 accumulator: summing many chunks in bf16 would lose precision
                if dl.dtype == torch.float32:
                    grad_w.addmm_(dl.t(), h.float())  # in place: no (V, H) temporary
                else:
                    grad_w.add_(dl.t() @ h.to(weight.dtype))
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 4096,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """log p(targets) under softmax(hidden @ weight^T + bias) without materialising all logits.

    hidden (N, H) float, weight (V, H) LM-head weight, targets (N,) long in [0, V), bias (V,) or None.
    Returns (N,) fp32. Differentiable w.r.t. hidden, weight and bias; the backward is chunked too.
    Peak extra memory ~ 2 * chunk_size * V * 4 bytes (one fp32 logits chunk plus its exp temporary).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"token_logprobs: need hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: targets must be (N,) = ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"token_logprobs: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"token_logprobs: targets must lie in [0, {weight.shape[0]})")
    return _TokenLogprobs.apply(hidden, weight, bias, targets.long(), int(chunk_size))
