"""Memory plan of a training run per GPU: weights, gradients, optimizer states and activations.

Parameters are counted exactly by building the model on the meta device (no memory, no weights needed).
Activations are *probed*, not guessed: one decoder layer of the real configuration runs forward on the meta
device under `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for the
backward with its shape and dtype. Two probe lengths separate the part linear in the tokens (per-token
activations) from the part quadratic in a row's length (the block mask, which SDPA converts to an additive
float mask in every layer). The LM head is counted from its shapes: the learner scores only masked
positions, in fp32 (hidden, logits and log-softmax output per scored token). `tests/infra/test_memory_plan.py`
checks the estimate against the bytes the tiny model really saves in a learner forward.

All sizes are bytes; `GB` below means 1e9 bytes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ebpo.model.configuration_llada2_moe import LLaDA2MoeConfig
from ebpo.model.routing import block_routing_active, routing_units

GB = 1e9
# DeepSpeed ZeRO-3's default cap on parameters gathered at once (`stage3_max_live_parameters`), in elements.
ZERO3_MAX_LIVE_PARAMETERS = 1e9


# ---------------------------------------------------------------------------------------------- parameters
def count_parameters(config: LLaDA2MoeConfig) -> dict[str, int]:
    """{"total", "active", "linear"} parameter counts (elements) of the model built from `config`.

    active: what one token touches (routed experts counted `num_experts_per_tok` of `num_experts`);
    linear: the weights that FP8 rollout quantises (attention and MLP projections, routed experts)."""
    from ebpo.model import LLaDA2MoeModelLM

    with torch.device("meta"):
        model = LLaDA2MoeModelLM(config)
    total = active = linear = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        routed = name.split(".")[-1] in ("gate_proj", "up_proj", "down_proj") and ".experts." in name + "."
        if routed and p.dim() == 3:
            active += n * config.num_experts_per_tok // config.num_experts
            linear += n
        else:
            active += n
            if p.dim() == 2 and "word_embeddings" not in name and "lm_head" not in name and ".gate." not in name:
                linear += n
    return {"total": total, "active": active, "linear": linear}


# --------------------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActivationProfile:
    """Bytes autograd saves in a forward with grad, by where they come from.

    per_token: all layers, embeddings and final norm, per token of a forward row;
    per_row_sq: per (row length)^2, for the whole model (the masks), independent of the row count;
    per_forward: independent of the tokens (the routers' weights cast to fp32 in every MoE layer);
    layer_input: one layer's input per token (all that gradient checkpointing keeps per layer);
    layer_max_per_token / layer_max_per_row_sq: the largest single layer (recomputed one at a time under
    gradient checkpointing); head_per_scored: per scored (masked) token: fp32 hidden, logits, log-softmax."""

    per_token: float
    per_row_sq: float
    per_forward: float
    layer_input: float
    layer_max_per_token: float
    layer_max_per_row_sq: float
    head_per_scored: float

    def saved_bytes(self, rows: int, row_len: int, scored: int, checkpointing: bool = False,
                    num_layers: int = 1) -> float:
        """Saved activations of one forward of `rows` rows of `row_len` tokens with `scored` scored tokens."""
        head = self.head_per_scored * scored
        if checkpointing:
            kept = self.layer_input * num_layers * rows * row_len
            one_layer = self.layer_max_per_token * rows * row_len + self.layer_max_per_row_sq * row_len ** 2
            return kept + one_layer + head
        return self.per_token * rows * row_len + self.per_row_sq * row_len ** 2 + self.per_forward + head


class _MetaGroupedMM(torch.autograd.Function):
    """Shape stand-in for `torch._grouped_mm` on the meta device for dtypes its meta function rejects; like
    the real op's backward it keeps both operands."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover (probes never run a backward)
        raise RuntimeError("meta probe only")


@contextlib.contextmanager
def _meta_grouped_mm(dtype: torch.dtype):
    if dtype == torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        yield
        return
    real = torch._grouped_mm
    torch._grouped_mm = lambda a, b, offs=None, **kw: _MetaGroupedMM.apply(a, b, offs)
    try:
        yield
    finally:
        torch._grouped_mm = real


class _FusedAttention(torch.autograd.Function):
    """Shape stand-in for a fused SDPA kernel (flash / memory-efficient, what CPU and GPU dispatch to for
    these masks) on the meta device, where SDPA would take the math path and keep every head's (L, L)
    probabilities. Keeps what the fused kernels' backward needs: q, k, v, the output, the fp32 row
    log-sum-exp and the mask converted to an additive bias of the query dtype."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        bias = mask.new_empty(mask.shape, dtype=q.dtype) if mask is not None else None
        ctx.save_for_backward(q, k, v, out, lse, *([bias] if bias is not None else []))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover (probes never run a backward)
        raise RuntimeError("meta probe only")


@contextlib.contextmanager
def _fused_attention():
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda q, k, v, attn_mask=None, **kw: _FusedAttention.apply(q, k, v, attn_mask)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def saved_tensor_bytes(fn, exclude: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensors autograd saves while `fn()` runs (views of one base counted once;
    parameters and `exclude` not counted). Works on real and meta tensors."""
    skip = {id(t) for t in exclude}
    seen: dict[int, int] = {}

    def base(t: torch.Tensor) -> torch.Tensor:
        while t._base is not None:
            t = t._base
        return t

    def pack(t: torch.Tensor):
        b = base(t)
        if isinstance(b, nn.Parameter) or id(b) in skip or id(b) in seen:
            return t
        seen[id(b)] = b.numel() * b.element_size()
        keep.append(b)  # ids stay unique while the probe runs
        return t

    keep: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _layer_probe(config: LLaDA2MoeConfig, layer_idx: int, dtype: torch.dtype, length: int) -> int:
    from ebpo.model.modeling_llada2_moe import LLaDA2MoeDecoderLayer

    with torch.device("meta"):
        layer = LLaDA2MoeDecoderLayer(config, layer_idx).to(dtype)
        x = torch.empty(1, length, config.hidden_size, dtype=dtype, requires_grad=True)
        pos = torch.zeros(1, length, dtype=torch.long)
        keep = torch.ones(1, 1, length, length, dtype=torch.bool)
        units = None
        if block_routing_active(config.block_routing_capacity, config.num_experts):
            units = routing_units(torch.arange(length)[None], config.block_size)
    with _meta_grouped_mm(dtype), _fused_attention():
        return saved_tensor_bytes(lambda: layer(x, pos, keep, None, units), exclude=[x, keep, pos])


def probe_activations(config: LLaDA2MoeConfig, dtype: torch.dtype, module_head: bool = False) -> ActivationProfile:
    """Measure one dense and one MoE layer of `config` on the meta device at three lengths (see module doc).
    module_head: the LM head runs through its module in checkpointed chunks (ZeRO-3), not the fp32 kernel."""
    lengths = (64, 128, 256)

    def fit(layer_idx):
        # b(n) = k + a n + c n^2 (k: per-forward copies such as the router weight cast to fp32)
        n = torch.tensor(lengths, dtype=torch.float64)
        b = torch.tensor([_layer_probe(config, layer_idx, dtype, m) for m in lengths], dtype=torch.float64)
        k, a, c = torch.linalg.solve(torch.stack([torch.ones_like(n), n, n * n], 1), b).tolist()
        return a, c, k

    kinds = []
    n_dense = min(config.first_k_dense_replace, config.num_hidden_layers)
    if n_dense:
        kinds.append((fit(0), n_dense))
    if config.num_hidden_layers > n_dense:
        kinds.append((fit(n_dense), config.num_hidden_layers - n_dense))
    d = torch.empty((), dtype=dtype).element_size()
    H = config.hidden_size
    per_token = sum(a * n for (a, _, _), n in kinds) + H * d + (4 * H + 4 + 2 * H * d)  # embeddings, final norm
    per_row_sq = sum(c * n for (_, c, _), n in kinds) + 1  # + the bool mask built once per forward
    per_forward = sum(k * n for (_, _, k), n in kinds)
    if not module_head and d != 4:  # the fp32 kernel head keeps an fp32 copy of a bf16 head weight
        per_forward += 4 * config.vocab_size * H
    # scored positions: the chunked fp32 head (`kernels.logprobs`) keeps the gathered hidden rows in fp32
    # and one log-sum-exp each; the ZeRO-3 module head keeps its checkpointed chunks' input rows
    head = 4 * H + 4 if not module_head else H * d + 4
    return ActivationProfile(per_token=per_token, per_row_sq=per_row_sq, per_forward=per_forward, layer_input=H * d,
                             layer_max_per_token=max(a for (a, _, _), _ in kinds),
                             layer_max_per_row_sq=max(c for (_, c, _), _ in kinds) + 1, head_per_scored=head)


# --------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class LearnerShape:
    """What the learner's memory depends on (plain values, taken from a recipe by `ebpo plan`).

    ranks: learner ranks W; dtype: "bf16" or "fp32"; backend: "deepspeed" or "torch"; zero_stage 0-3;
    offload_optimizer / offload_param: ZeRO CPU offload; reference_copy: a frozen reference model is kept;
    row_len: a micro-batch row's length in tokens (prompt + response); rows: rows per micro-batch;
    draws_per_forward: noise draws in one forward with grad; packed: draws share one clean copy;
    mask_fraction: expected fraction of response tokens masked per draw; response_len: tokens per row that
    can be scored; checkpointing: gradient checkpointing."""

    ranks: int
    dtype: str
    backend: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    reference_copy: bool
    rows: int
    row_len: int
    response_len: int
    draws_per_forward: int
    packed: bool
    mask_fraction: float
    checkpointing: bool


def learner_memory(config: LLaDA2MoeConfig, shape: LearnerShape, profile: ActivationProfile | None = None) -> dict:
    """Bytes per learner GPU: {"weights", "grads", "optimizer", "zero3_gather", "reference", "activations",
    "total"} and per node's host RAM for offloaded states {"host_per_rank"}."""
    P = count_parameters(config)["total"]
    bf16 = shape.dtype == "bf16"
    w_b, g_b = (2, 2) if bf16 else (4, 4)
    opt_b = 12 if bf16 else 8  # fp32 master copy (mixed precision only) + two fp32 Adam moments
    W = shape.ranks
    sharded = shape.backend == "deepspeed"
    stage = shape.zero_stage if sharded else 0
    weights = P * w_b / (W if stage >= 3 else 1)
    grads = P * g_b / (W if stage >= 2 else 1)
    optimizer = P * opt_b / (W if stage >= 1 else 1)
    host = 0.0
    if sharded and shape.offload_optimizer:
        host += optimizer
        optimizer = 0.0
    if sharded and stage == 3 and shape.offload_param:
        host += weights
        weights = 0.0
    gather = min(ZERO3_MAX_LIVE_PARAMETERS, P) * w_b if stage == 3 else 0.0
    reference = P * w_b / (W if stage >= 3 else 1) if shape.reference_copy else 0.0
    profile = profile or probe_activations(config, torch.bfloat16 if bf16 else torch.float32)
    S = shape.draws_per_forward
    if shape.packed:
        rows, row_len = shape.rows, (S + 1) * shape.row_len
    else:
        rows, row_len = shape.rows * S, 2 * shape.row_len
    scored = int(round(shape.rows * S * shape.response_len * shape.mask_fraction))
    acts = profile.saved_bytes(rows, row_len, scored, shape.checkpointing, config.num_hidden_layers)
    total = weights + grads + optimizer + gather + reference + acts
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "zero3_gather": gather,
            "reference": reference, "activations": acts, "total": total, "host_per_rank": host,
            "forward_rows": rows, "forward_row_len": row_len, "scored_tokens": scored}


def expert_working_set(config: LLaDA2MoeConfig, blocks: int, block_size: int, bytes_per_weight: float) -> dict:
    """Routed experts one forward over `blocks` blocks of `block_size` tokens can touch, per MoE layer, and the
    bytes of their weights over all MoE layers: {"experts_per_block", "experts_per_layer", "bytes"}, and
    "bytes_per_block", what one block alone reads (the batch-1 decode forward).

    Per block the bound is min(E, block_size * k) with per-token routing and C with block routing
    (`block_routing_capacity`, docs/background.md section 9); a forward touches at most min(E, blocks * that).
    """
    E, k = config.num_experts, config.num_experts_per_tok
    C = config.block_routing_capacity
    per_block = C if block_routing_active(C, E) else min(E, block_size * k)
    per_layer = min(E, blocks * per_block)
    moe_layers = max(0, config.num_hidden_layers - config.first_k_dense_replace)
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    return {"experts_per_block": per_block, "experts_per_layer": per_layer,
            "bytes": per_layer * per_expert * moe_layers * bytes_per_weight,
            "bytes_per_block": per_block * per_expert * moe_layers * bytes_per_weight}


def parameter_groups(config: LLaDA2MoeConfig) -> dict[str, int]:
    """Parameter counts (elements) of the model built from `config`, by how a tensor- and expert-parallel
    rollout worker splits them (their sum is `count_parameters(config)["total"]`):

    routed: the routed experts (3-D), split over the expert-parallel ranks; q: the query rows of
    `query_key_value` and the attention output projection, split by heads over the tensor-parallel ranks;
    kv: the key and value rows of `query_key_value`, split by KV heads (replicated when there are fewer KV
    heads than ranks); mlp: the dense MLP and the shared experts, split over the tensor-parallel ranks;
    vocab: word embeddings and LM head, split by vocabulary rows over the tensor-parallel ranks;
    replicated: norms and routers, whole on every rank. All but vocab and replicated are what FP8 quantises.
    """
    from ebpo.model import LLaDA2MoeModelLM

    with torch.device("meta"):
        model = LLaDA2MoeModelLM(config)
    kv_rows = 2 * config.num_key_value_heads * config.head_dim
    groups = dict.fromkeys(("routed", "q", "kv", "mlp", "vocab", "replicated"), 0)
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts." in name and p.dim() == 3:
            groups["routed"] += n
        elif name.endswith("query_key_value.weight"):
            groups["kv"] += kv_rows * p.shape[1]
            groups["q"] += n - kv_rows * p.shape[1]
        elif name.endswith("attention.dense.weight"):
            groups["q"] += n
        elif p.dim() == 2 and ("word_embeddings" in name or "lm_head" in name):
            groups["vocab"] += n
        elif p.dim() == 2 and ".gate." not in name:
            groups["mlp"] += n
        else:
            groups["replicated"] += n
    return groups


def parallel_ranks(tensor_parallel: int, expert_parallel: int) -> int:
    """Ranks of one rollout worker: max(tp, ep) (one divides the other, `RolloutConfig.validate`), grouped as
    `ebpo.model.parallel.layout.make_groups` does: consecutive ranks per tp group and per ep group, every rank
    running the worker's whole batch (activations are replicated over the groups)."""
    return max(tensor_parallel, expert_parallel)


FP8_BYTES = 1 + 4 / (128 * 128)  # one byte per weight and one fp32 scale per 128 x 128 block


def rollout_memory(config: LLaDA2MoeConfig, fp8: bool, sequences: int, seq_len: int, block_size: int,
                   tensor_parallel: int = 1, expert_parallel: int = 1, prompt_len: int = 0) -> dict:
    """Bytes per rollout GPU (per rank of a worker that spans `parallel_ranks(tp, ep)` ranks): weights (bf16;
    FP8: the linear layers and experts at `FP8_BYTES`), a bf16 KV cache for `sequences` rows of `seq_len`
    tokens, the fp32 logits of one block per row, and the all-to-all buffers of the experts.
    {"weights", "kv_cache", "logits", "all_to_all", "total"}, plus the routed-expert working set of one
    decode forward (every sequence's active block; block routing bounds it by C per block): "experts_per_block",
    "experts_per_forward" (per MoE layer) and "expert_bytes_per_forward" (weights read by the whole worker, all
    MoE layers; part of "weights", not added to the total).

    Layout (`parameter_groups`, as `ebpo.model.parallel` splits the model): attention heads, dense MLP, shared
    experts and the vocabulary rows of the embeddings and LM head over tp ranks (KV heads over min(tp, KV
    heads) ranks, replicated beyond), routed experts over ep ranks. Every rank runs all of the worker's
    `sequences` (activations replicated), so it holds their KV cache for its KV heads and their logits for its
    vocabulary rows. All-to-all: the largest forward is the one that admits every sequence at once (its
    prompt blocks and first block: `prompt_len` // K + 1 blocks per row, T tokens); each rank dispatches its
    1/ep slice of the T tokens, top-k copies of the hidden state each (bf16), and receives at most every EP
    rank's slice routed to its own experts (min(k, E / ep) copies of each row): a send and a receive buffer
    for the dispatch and the same for the combine.
    """
    tp, ep = tensor_parallel, expert_parallel
    W = parallel_ranks(tp, ep)
    g = parameter_groups(config)
    q_b = FP8_BYTES if fp8 else 2  # bytes of a quantised weight
    kv_split = min(tp, config.num_key_value_heads)
    weights = (g["routed"] / ep * q_b + (g["q"] + g["mlp"]) / tp * q_b + g["kv"] / kv_split * q_b
               + g["vocab"] / tp * 2 + g["replicated"] * 2)
    kv_heads = config.num_key_value_heads // kv_split
    kv = 2 * config.num_hidden_layers * kv_heads * config.head_dim * 2 * sequences * seq_len
    logits = sequences * block_size * (-(-config.vocab_size // tp)) * 4
    all_to_all = 0.0
    E, k = config.num_experts, config.num_experts_per_tok
    if ep > 1 and E:
        tokens = sequences * (prompt_len // block_size + 1) * block_size
        sent = -(-tokens // ep) * k
        received = ep * -(-tokens // ep) * min(k, E // ep)
        all_to_all = 2 * (sent + received) * config.hidden_size * 2
    ws = expert_working_set(config, sequences, block_size, FP8_BYTES if fp8 else 2)
    return {"weights": weights, "kv_cache": kv, "logits": logits, "all_to_all": all_to_all,
            "total": weights + kv + logits + all_to_all, "ranks": W, "tensor_parallel": tp, "expert_parallel": ep,
            "kv_heads_per_rank": kv_heads,
            "experts_per_block": ws["experts_per_block"], "experts_per_forward": ws["experts_per_layer"],
            "expert_bytes_per_forward": ws["bytes"], "expert_bytes_per_block": ws["bytes_per_block"]}
