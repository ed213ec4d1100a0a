"""Shared harness of the parallel-model tests: the same scenarios run on the single-process model (here) and on
the parallel model in gloo ranks (`torch.multiprocessing.spawn`), once per world size and test session.

Each rank streams the full state dict (name, tensor) by (name, tensor) into its shards, runs every scenario for
every layout, and saves what it computed; the tests compare that with the single-process results.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ebpo.infra.distributed import free_port
from ebpo.model import BlockKVCache, LLaDA2MoeModelLM, tiny_config
from ebpo.model.masks import block_causal_mask
from ebpo.model.parallel import VocabShard, build_parallel_model, sharded_candidates, sharded_token_probs
from kernels.fp8 import convert_model_to_fp8
from rollout.sampling import candidates_reference

MASK_ID, EDIT_IDS = 2, [105, 106]
B, BLOCK = 3, 8
# name -> (config overrides, dtype, fp8). float64 runs use the dense experts (grouped GEMMs take fp32/bf16 only).
CASES = {
    "f64": (dict(moe_impl="dense"), torch.float64, False),
    "routing": (dict(moe_impl="dense", num_hidden_layers=2, block_routing_capacity=3), torch.float64, False),
    "f32": (dict(num_hidden_layers=2), torch.float32, False),
    # 128-aligned tensor-parallel slices: head_dim 128, 128 dense / shared units per rank at tp=2
    "fp8": (dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                 intermediate_size=256, moe_intermediate_size=128, num_shared_experts=2), torch.float32, True),
}
LAYOUTS = {2: [(2, 1), (1, 2), (2, 2)], 4: [(1, 4), (2, 4), (4, 4)]}
FP8_TP = (1, 2)  # the fp8 case's config splits its heads at most in two
SAMPLING = [  # (name, temperature, top_k, top_p, penalty, logit scale)
    ("greedy", 0.0, 0, 1.0, 0.0, 3.0),
    ("greedy_penalty", 0.0, 0, 1.0, 2.0, 3.0),
    ("plain", 0.9, 0, 1.0, 0.0, 3.0),
    ("top_k", 0.7, 5, 1.0, 0.0, 3.0),
    ("top_k1", 1.0, 1, 1.0, 0.0, 3.0),
    ("top_p", 1.0, 0, 0.8, 0.0, 3.0),
    ("top_p_flat", 1.5, 0, 0.95, 0.0, 0.3),  # nucleus of ~900 tokens: the sharded search grows past 256
    ("top_k_top_p", 0.8, 50, 0.9, 0.5, 3.0),
]
SAMPLING_V, SAMPLING_K = 1024, 4


def config(case: str):
    return tiny_config(initializer_range=0.2, **CASES[case][0])


def reference_model(case: str) -> LLaDA2MoeModelLM:
    """The single-process model of a case, from a fixed seed (FP8 cases converted after the seed's weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaDA2MoeModelLM(config(case)).to(CASES[case][1]).eval()
    return model


def generators(seed: int = 100) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + b) for b in range(B)]


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"ids": torch.randint(3, 100, (B, 3 * BLOCK), generator=g),
            "step3": torch.randint(3, 100, (B, BLOCK), generator=g)}


def model_scenarios(model, cand, probs, make_cache) -> dict:
    """Every forward the tests compare, through the shared forward signature. cand(h, T, top_k, top_p, gens)
    and probs(h, ids) give candidates / edit probabilities; make_cache(batch, max_len) a prefix cache."""
    x, out = inputs(), {}
    with torch.no_grad():
        o = model(x["ids"], return_logits=True)
        out["hidden"], out["logits"] = o.last_hidden_state, o.logits
        h = o.last_hidden_state[:, 2 * BLOCK:]
        out["greedy"] = cand(h, 0.0, 0, 1.0, None)
        out["sampled"] = cand(h, 0.8, 20, 0.9, generators())
        out["sampled_plain"] = cand(h, 1.0, 0, 1.0, generators(7))
        out["eprob"] = probs(h, EDIT_IDS)
        out.update(_cache_flow(model, x, make_cache))
    return out


def _cache_flow(model, x, make_cache) -> dict:
    """Prompt of two blocks into the cache; one block for rows [2, 0] with partial commits; then all rows at
    unequal lengths (non-uniform prefix), with a ragged token mask."""
    cache = make_cache(B, 5 * BLOCK)
    o1 = model(x["ids"][:, :2 * BLOCK], attention_mask=block_causal_mask(2 * BLOCK, BLOCK)[None, None], cache=cache,
               return_logits=False)
    cache.commit(2 * BLOCK)
    o2 = model(x["ids"][[2, 0], 2 * BLOCK:], position_ids=torch.arange(2 * BLOCK, 3 * BLOCK), cache=cache,
               cache_rows=[2, 0], return_logits=False)
    cache.commit([BLOCK, 3])
    pos = torch.tensor([[cache.lengths[r] + j for j in range(BLOCK)] for r in range(B)])
    token_mask = torch.ones(B, BLOCK, dtype=torch.bool)
    token_mask[1, 5:] = False
    o3 = model(x["step3"], position_ids=pos, cache=cache, cache_rows=[0, 1, 2], token_mask=token_mask,
               return_logits=False)
    return {"cache_hidden": [o1.last_hidden_state, o2.last_hidden_state,
                             o3.last_hidden_state.masked_fill(~token_mask[..., None], 0.0)],
            "cache_k": [k.clone() for k in cache.k], "cache_v": [v.clone() for v in cache.v],
            "cache_lengths": list(cache.lengths)}


def single_scenarios(model) -> dict:
    """model_scenarios on the single-process model, candidates from `rollout.sampling` (the decoder's sampler)."""

    def logits_of(h):
        logits = model.lm_head(h).float()
        logits[..., MASK_ID] = float("-inf")
        return logits

    def cand(h, T, top_k, top_p, gens):
        return candidates_reference(logits_of(h), T, top_k, top_p, gens)

    def probs(h, ids):
        return logits_of(h).softmax(-1)[..., ids]

    return model_scenarios(model, cand, probs,
                           lambda b, n: BlockKVCache.for_model(model.config, b, n, dtype=model.dtype))


def parallel_scenarios(model) -> dict:
    def cand(h, T, top_k, top_p, gens):
        return model.candidates(h, T, top_k, top_p, gens, banned=[MASK_ID])

    def probs(h, ids):
        return model.token_probs(h, ids, banned=[MASK_ID])

    dtype = next(model.model.norm.parameters()).dtype
    return model_scenarios(model, cand, probs, lambda b, n: model.new_cache(b, n, dtype=dtype))


def sampling_logits(scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, SAMPLING_K, SAMPLING_V, generator=g) * scale
    x[0, 0, [3, SAMPLING_V - 5]] = x[0, 0].max() + 1.0  # an exact tie across the shards: argmax takes index 3
    return x


def suppress_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(6)
    s = torch.randint(-1, SAMPLING_V, (B, SAMPLING_K), generator=g)
    s[0, 0] = 3  # penalise the tied winner: the other tied token wins
    return s


def single_sampling() -> dict:
    out = {}
    for name, T, k, p, pen, scale in SAMPLING:
        out[name] = candidates_reference(sampling_logits(scale), T, k, p, generators(), suppress_ids(), pen)
    out["probs"] = sampling_logits(3.0).softmax(-1)[..., [3, 500, SAMPLING_V - 1]]
    return out


def parallel_sampling(group) -> dict:
    P, r = dist.get_world_size(group), dist.get_rank(group)
    n = SAMPLING_V // P
    shard = VocabShard(r * n, (r + 1) * n, SAMPLING_V, group)
    out = {}
    for name, T, k, p, pen, scale in SAMPLING:
        local = sampling_logits(scale)[..., shard.start:shard.stop]
        out[name] = sharded_candidates(local, shard, T, k, p, generators(), suppress_ids(), pen)
    out["probs"] = sharded_token_probs(sampling_logits(3.0)[..., shard.start:shard.stop], shard, [3, 500, SAMPLING_V - 1])
    return out


def _groups(world: int, sizes) -> dict:
    """Process group of each axis size: None (1), the world, or this rank's consecutive subgroup. Every rank
    creates the subgroups in the same order."""
    groups = {1: None, world: dist.group.WORLD}
    for n in sorted(set(sizes) - set(groups)):
        groups[n] = dist.new_subgroups(group_size=n)[0]
    return groups


def worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layouts = LAYOUTS[world]
        groups = _groups(world, [n for layout in layouts for n in layout])
        results = {"sampling": parallel_sampling(dist.group.WORLD)}
        for case, (_, dtype, fp8) in CASES.items():
            state = torch.load(Path(folder) / f"{case}.pt", mmap=True)
            for tp, ep in layouts:
                if fp8 and tp not in FP8_TP:
                    continue
                # streamed: one full tensor at a time goes by, the rank keeps its slices
                model = build_parallel_model(iter(state.items()), config(case), groups[tp], groups[ep], fp8=fp8,
                                             dtype=dtype)
                results[f"{tp}x{ep}/{case}"] = parallel_scenarios(model)
                results[f"{tp}x{ep}/{case}/kv_heads"] = list(model.layout.kv_heads(model.config))
        torch.save(results, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


_RUNS: dict[int, list[dict]] = {}


def run_ranks(world: int) -> list[dict]:
    """Every rank's results at `world` ranks (run once per session)."""
    if world not in _RUNS:
        folder = tempfile.mkdtemp(prefix=f"parallel{world}_")
        for case in CASES:
            torch.save(reference_model(case).state_dict(), Path(folder) / f"{case}.pt")
        mp.spawn(worker, args=(world, free_port(), folder), nprocs=world, join=True)
        _RUNS[world] = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(world)]
    return _RUNS[world]


_REFERENCE: dict[str, dict] = {}


def reference(case: str) -> dict:
    """Single-process results of a case (the FP8 case on the single-process FP8 conversion)."""
    if case not in _REFERENCE:
        model = reference_model(case)
        if CASES[case][2]:
            model = convert_model_to_fp8(model)
        _REFERENCE[case] = single_scenarios(model)
    return _REFERENCE[case]


# ------------------------------------------------------------------------------------------- tolerances
EPS32 = torch.finfo(torch.float32).eps


def hidden_tolerance(case: str, magnitude: float) -> float:
    """Bound on |parallel - single| of hidden states (and cached keys/values) of magnitude M.

    Every value of these models passes through fp32 (RMSNorm and the router compute in fp32, float64 runs
    included), so fp32 rounding is the floor. Per sublayer, the parallel model reorders sums (a partial sum per
    rank over R / tp terms, then the all-reduce): a rounding error of order eps32 * sqrt(R) * M for a reduction
    of length R; the residual stream adds the 2 * layers sublayers' errors."""
    c = config(case)
    R = max(c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim,
            c.moe_intermediate_size * max(c.num_shared_experts, 1))
    return 2 * c.num_hidden_layers * EPS32 * R ** 0.5 * magnitude


def logits_tolerance(case: str, lm_head: torch.Tensor, hidden_tol: float, magnitude: float) -> float:
    """Bound on |parallel - single| logits: the hidden-state bound through the LM head plus the head's own
    reduction over the hidden size. Rounding differences are not aligned with a weight row, so they add up like a
    random walk: the row's L2 norm (largest row) carries the per-element bound."""
    return hidden_tol * float(lm_head.norm(dim=-1).max()) + EPS32 * config(case).hidden_size ** 0.5 * magnitude


def prob_rtol(logit_scale: float, vocab: int, logits_tol: float = 0.0) -> float:
    """Relative bound on a candidate probability exp(x - lse): the fp32 roundings of x - lse (of size up to
    |x| + log V) and of the log-sum-exp, plus twice the logits' own difference."""
    return 4 * EPS32 * (logit_scale + float(torch.tensor(vocab).log()) + 1) + 2 * logits_tol


def clear_of_thresholds(logits: torch.Tensor, T: float, top_k: int, top_p: float, gens, margin: float):
    """(B, K) bool: positions whose candidate cannot change when the logits move by less than `margin`: the
    two best keys (logits, or tempered filtered logits + the rows' Gumbel noise) differ by more than 2 margins,
    the kept set is separated from the dropped values by more than 2, and no token's top-p mass before it lies
    within 4 margins of top_p (a margin moves each probability by at most a factor exp(2 margin))."""
    from rollout.sampling import filter_top_k_top_p, gumbel_noise

    if T == 0:
        top2 = logits.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1] > 2 * margin
    m = margin / T
    x = logits.float() / T
    xf = filter_top_k_top_p(x, top_k, top_p)
    kept = torch.isfinite(xf)
    clear = (xf.masked_fill(~kept, float("inf")).min(-1).values
             - x.masked_fill(kept, float("-inf")).max(-1).values) > 2 * m
    if top_p < 1.0:
        p = filter_top_k_top_p(x, top_k, 1.0).sort(dim=-1, descending=True).values.softmax(-1)
        clear &= ((p.cumsum(-1) - p) - top_p).abs().min(-1).values > 4 * m
    noise = torch.stack([gumbel_noise(x.shape[1:], g, x.device) for g in gens])
    keys = (xf + noise).topk(2, dim=-1).values
    return clear & (keys[..., 0] - keys[..., 1] > 2 * m)
