"""Per-block FP8 layers for rollout workers: `FP8Linear`, `FP8Experts`, model conversion, re-quantisation.

    model = convert_model_to_fp8(model)          # nn.Linear -> FP8Linear, stacked MoE experts -> FP8Experts
    requantize_model_(model, learner_state_dict)  # after every weight sync: re-quantise in place

Kept in bf16/fp32 (docs/background.md section 8): embeddings, LM head, the MoE router (`mlp.gate`), norms and
attention math. The quantisation ops themselves live in `kernels.fp8_ops` and are re-exported here.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_ops import (BLOCK, FP8_DTYPE, FP8_MAX, _cdiv, dequantize_act_per_token_group,  # noqa: F401
                      dequantize_weight_blockwise, fp8_block_matmul, quantize_act_per_token_group,
                      quantize_weight_blockwise)

_PROJS = ("gate_proj", "up_proj", "down_proj")


class FP8Linear(nn.Module):
    """y = x @ W^T + b with W stored as per-block FP8 (buffers `weight` fp8 (N, K), `weight_scale` fp32).

    Inference only (no gradient). Output dtype = input dtype; the bias stays in its original dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 bias_dtype: torch.dtype = torch.float32, backend: str = "auto"):
        super().__init__()
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(_cdiv(out_features, BLOCK), _cdiv(in_features, BLOCK),
                                                        dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> "FP8Linear":
        """Quantise an nn.Linear (any float dtype, any device) into a new FP8Linear on the same device."""
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=w.device,
                bias_dtype=linear.bias.dtype if linear.bias is not None else torch.float32, backend=backend)
        m.requantize_(w)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    @torch.no_grad()
    def requantize_(self, new_weight: torch.Tensor) -> "FP8Linear":
        """Re-quantise from a float weight (out, in) in place (no reallocation); returns self."""
        if tuple(new_weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"FP8Linear.requantize_: weight shape {tuple(new_weight.shape)} != "
                             f"{tuple(self.weight.shape)}")
        w = new_weight.detach().to(self.weight.device)
        quantize_weight_blockwise(w, backend=self.backend, out=(self.weight, self.weight_scale))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_block_matmul(x, self.weight, self.weight_scale, out_dtype=x.dtype, backend=self.backend)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8 128x128"


class FP8Experts(nn.Module):
    """FP8 version of a stacked MoE experts module: gate/up (E, F, H), down (E, H, F) as per-block FP8.

    forward(x (T, H), topk_idx (T, k) long, topk_weight (T, k)) -> (T, H)
      = sum_j topk_weight[:, j] * down_e(silu(gate_e(x)) * up_e(x)),  e = topk_idx[:, j].
    Token-expert pairs are sorted by expert and each expert with tokens runs its three FP8 GEMMs (the
    inputs of gate/up are quantised once). One host sync per call (the per-expert counts).
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, device=None, backend: str = "auto"):
        super().__init__()
        self.num_experts, self.hidden, self.ffn, self.backend = num_experts, hidden, ffn, backend
        for name, (n, k) in zip(_PROJS, ((ffn, hidden), (ffn, hidden), (hidden, ffn))):
            self.register_buffer(name, torch.zeros(num_experts, n, k, dtype=FP8_DTYPE, device=device))
            self.register_buffer(name + "_scale", torch.ones(num_experts, _cdiv(n, BLOCK), _cdiv(k, BLOCK),
                                                             dtype=torch.float32, device=device))

    @classmethod
    def from_experts(cls, experts: nn.Module, backend: str = "auto") -> "FP8Experts":
        """Build from any module holding stacked `gate_proj`/`up_proj` (E, F, H) and `down_proj` (E, H, F)."""
        if not is_stacked_experts(experts):
            raise TypeError(f"{type(experts).__name__} does not hold stacked 3-D gate_proj/up_proj/down_proj")
        E, Fd, H = experts.gate_proj.shape
        m = cls(E, H, Fd, device=experts.gate_proj.device, backend=backend)
        for name in _PROJS:
            m.requantize_(name, getattr(experts, name))
        return m

    @torch.no_grad()
    def requantize_(self, proj: str, new_weight: torch.Tensor, expert: int | None = None) -> "FP8Experts":
        """Re-quantise projection `proj` from float weights: the whole stack, or one expert's (out, in)."""
        if proj not in _PROJS:
            raise ValueError(f"FP8Experts.requantize_: unknown projection {proj!r}; expected one of {_PROJS}")
        q, s = getattr(self, proj), getattr(self, proj + "_scale")
        if expert is not None:
            q, s = q[expert], s[expert]
        if tuple(new_weight.shape) != tuple(q.shape):
            raise ValueError(f"FP8Experts.requantize_: {proj} shape {tuple(new_weight.shape)} != {tuple(q.shape)}")
        quantize_weight_blockwise(new_weight.detach().to(q.device), backend=self.backend, out=(q, s))
        return self

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                pool: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, H), topk_idx/topk_weight (T, k) -> (T, H). pool (block routing's admitted experts) is accepted
        and not needed: only the experts with tokens are multiplied (host-side counts below)."""
        T, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[token_of]
        xq, xsc = quantize_act_per_token_group(xs, BLOCK, backend=self.backend)
        y = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sl = slice(start, start + c)
            start += c
            g = fp8_block_matmul(xq[sl], self.gate_proj[e], self.gate_proj_scale[e], x.dtype, self.backend, xsc[sl])
            u = fp8_block_matmul(xq[sl], self.up_proj[e], self.up_proj_scale[e], x.dtype, self.backend, xsc[sl])
            y[sl] = fp8_block_matmul(F.silu(g) * u, self.down_proj[e], self.down_proj_scale[e], x.dtype, self.backend)
        w = topk_weight.reshape(-1)[order].to(y.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, y * w[:, None])
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, ffn={self.ffn}, fp8 128x128"


def is_stacked_experts(m: nn.Module) -> bool:
    """Duck-typing for a stacked experts module (so `kernels` need not import the model)."""
    if isinstance(m, FP8Experts):
        return False
    ws = [getattr(m, n, None) for n in _PROJS]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in ws):
        return False
    (E, Fd, H), up, down = ws[0].shape, ws[1].shape, ws[2].shape
    return tuple(up) == (E, Fd, H) and tuple(down) == (E, H, Fd) and callable(getattr(m, "forward", None))


def convert_model_to_fp8(model: nn.Module, skip_names=("lm_head", "gate", "word_embeddings"),
                         backend: str = "auto") -> nn.Module:
    """Replace, in place, every nn.Linear by FP8Linear and every stacked-experts module by FP8Experts.

    A module whose own name (last dotted component) is in `skip_names` is left alone with its children
    (so the router `mlp.gate` stays, while `gate_proj` is converted). Norms and embeddings are not Linear
    and stay untouched. Returns the model.
    """
    skip = set(skip_names)

    def visit(parent: nn.Module):
        for name, child in list(parent.named_children()):
            if name in skip:
                continue
            if isinstance(child, nn.Linear):
                setattr(parent, name, FP8Linear.from_linear(child, backend=backend))
            elif is_stacked_experts(child):
                setattr(parent, name, FP8Experts.from_experts(child, backend=backend))
            else:
                visit(child)

    visit(model)
    return model


_PER_EXPERT = re.compile(r"^(?:(.*)\.)?(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _split(key: str) -> tuple[str, str]:
    prefix, _, attr = key.rpartition(".")
    return prefix, attr


def expected_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the unconverted model that `requantize_model_` expects for a converted model."""
    keys: set[str] = set()
    fp8_prefixes = []
    for name, m in model.named_modules():
        pre = name + "." if name else ""
        if isinstance(m, FP8Linear):
            keys.add(pre + "weight")
            if m.bias is not None:
                keys.add(pre + "bias")
            fp8_prefixes.append(pre)
        elif isinstance(m, FP8Experts):
            keys.update(pre + p for p in _PROJS)
            fp8_prefixes.append(pre)
    for name in model.state_dict().keys():
        if not any(name.startswith(p) for p in fp8_prefixes):
            keys.add(name)
    return keys


@torch.no_grad()
def requantize_model_(model: nn.Module, state_dict: dict, strict: bool = True,
                      allow_missing: bool = False) -> nn.Module:
    """Load a float state_dict of the ORIGINAL model into a converted model, re-quantising FP8 layers.

    Accepts stacked-expert keys (`...mlp.experts.gate_proj`) and released per-expert keys
    (`...mlp.experts.7.gate_proj.weight`). Other entries (norms, embeddings, router, lm_head) are copied.
    strict=True raises a ValueError naming missing and unexpected keys; with allow_missing=True only
    unexpected keys raise (a part of a state dict, e.g. one broadcast bucket). Returns the model.
    """
    own = model.state_dict(keep_vars=True)
    seen: set[str] = set()
    unexpected: list[str] = []
    expert_parts: dict[str, set[int]] = {}
    for key, value in state_dict.items():
        prefix, attr = _split(key)
        mod = _get(model, prefix)
        if isinstance(mod, FP8Linear) and attr in ("weight", "bias"):
            if attr == "weight":
                mod.requantize_(value)
            else:
                mod.bias.copy_(value)
            seen.add(key)
            continue
        if isinstance(mod, FP8Experts) and attr in _PROJS:
            mod.requantize_(attr, value)
            seen.add(key)
            continue
        match = _PER_EXPERT.match(key)
        if match:
            pre, e, proj = match.group(1) or "", int(match.group(2)), match.group(3)
            emod = _get(model, pre)
            if isinstance(emod, FP8Experts):
                emod.requantize_(proj, value, expert=e)
                expert_parts.setdefault(f"{pre}.{proj}" if pre else proj, set()).add(e)
                continue
        if key in own and not any(isinstance(_get(model, _split(key)[0]), c) for c in (FP8Linear, FP8Experts)):
            own[key].copy_(value)
            seen.add(key)
            continue
        unexpected.append(key)
    for key, experts in expert_parts.items():
        mod = _get(model, _split(key)[0])
        if len(experts) == mod.num_experts:
            seen.add(key)
    if strict:
        missing = [] if allow_missing else sorted(expected_keys(model) - seen)
        if missing or unexpected:
            raise ValueError(f"requantize_model_: missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                             f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return model


def _get(model: nn.Module, path: str):
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None
