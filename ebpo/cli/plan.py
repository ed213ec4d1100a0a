"""`ebpo plan RECIPE [key=value ...] [--gpus-per-node 8] [--gpu-mem-gb 80] [--nodes 1] [--json FILE]`:
the memory plan of an RL recipe per GPU, without running anything.

    ebpo plan recipes/rl_math_llada21_mini.yaml model=preset:mini
    ebpo plan recipes/rl_math_llada21_mini.yaml model=preset:flash learner.num_workers=28 --nodes 4

Only the model's configuration is read (a folder's config.json or `preset:NAME`): the weights are not
needed. Learner ranks: weights, gradients and AdamW states under the recipe's ZeRO stage, offload and
dtype; the ZeRO-3 gather working set; activations of the largest micro-batch the token budget allows
(probed on the meta device: `ebpo.infra.memory_plan`). Rollout workers, per rank of a worker that spans
max(rollout.tensor_parallel, rollout.expert_parallel) ranks: weights (bf16 or FP8) split over the ranks, the KV
cache of its share of a step's rollouts, one block of logits and the experts' all-to-all buffers. A layout the
model cannot take (heads, KV heads or experts not divisible) is an error naming the key (exit status 2); exit
status 1 when a role does not fit or the roles need more GPUs than the cluster has.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ebpo.infra.config import ConfigError, load_config
from ebpo.model.routing import block_routing_active
from ebpo.infra.memory_plan import GB, LearnerShape, count_parameters, learner_memory, probe_activations, rollout_memory


def model_config(spec: str):
    """The model configuration of a recipe's `model`: a folder with config.json, a shipped name, or a preset."""
    from ebpo.model.configuration_llada2_moe import LLaDA2MoeConfig
    from ebpo.model.loading import resolve_model_path
    from ebpo.model.presets import load_preset

    spec = resolve_model_path(spec)
    if spec.startswith("preset:"):
        return load_preset(spec[len("preset:"):].partition("@")[0])
    if (Path(spec) / "config.json").exists():
        return LLaDA2MoeConfig.from_pretrained(spec)
    raise ConfigError(f"model: {spec!r} has no config.json here; name a preset instead (model=preset:mini or "
                      "model=preset:flash) to plan without the weights")


def check_rollout_layout(rc, config) -> None:
    """`rollout.tensor_parallel` / `rollout.expert_parallel` against the model: heads, KV heads and experts with
    the allowed values (`RolloutConfig.check_parallel`), then everything the parallel model splits
    (`ebpo.model.parallel.layout.check_layout`: vocabulary and MLP widths, FP8 128-wide blocks); ConfigError."""
    from ebpo.model.parallel.layout import ParallelLayout, check_layout

    rc.check_parallel(config.num_attention_heads, config.num_key_value_heads, config.num_experts or 0)
    try:
        check_layout(config, ParallelLayout(tp_size=rc.tensor_parallel, ep_size=rc.expert_parallel, fp8=rc.fp8))
    except ValueError as err:
        raise ConfigError(f"rollout.tensor_parallel = {rc.tensor_parallel}, rollout.expert_parallel = "
                          f"{rc.expert_parallel}, rollout.fp8 = {str(rc.fp8).lower()}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ebpo plan", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("recipe", help="an RL recipe (YAML)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. model=preset:mini")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node; the recipe's roles are placed on them (default: %(default)s)")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0,
                   help="usable memory per GPU, GB (1e9 bytes) (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")
    return p


def plan(cfg, gpus_per_node: int, gpu_mem_gb: float, nodes: int) -> dict:
    """The plan of a loaded `RLConfig` on `nodes` x `gpus_per_node` GPUs of `gpu_mem_gb` GB."""
    config = model_config(cfg.model)
    lc = cfg.learner
    K = lc.block_size or config.block_size
    if cfg.env.multi_turn:  # a trajectory's row: prompt, turns and tool results, up to env.turns.max_total_tokens
        seq = cfg.env.turns.max_total_tokens
        max_new = seq - min(cfg.data.max_prompt_tokens, seq)
    else:
        max_new = int(cfg.rollout.decode.get("max_new_tokens", 256))
        seq = cfg.data.max_prompt_tokens + max_new
    row_len = math.ceil(seq / K) * K
    budget = lc.max_tokens_per_microbatch
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    per_rank_rows = math.ceil(batch / lc.num_workers) if lc.minibatch_size <= 0 else math.ceil(
        lc.minibatch_size / lc.num_workers)
    rows = max(1, min(per_rank_rows, budget // row_len)) if budget > 0 else per_rank_rows
    draws = min(lc.replay_chunk, lc.n_draws) if lc.grad_replay else lc.n_draws
    module_head = lc.backend == "deepspeed" and lc.zero_stage == 3
    bf16 = lc.dtype == "bf16"
    import torch

    profile = probe_activations(config, torch.bfloat16 if bf16 else torch.float32, module_head=module_head)
    mask_fraction = 0.5 * (1 + 1 / K) if lc.noise == "exact_elbo" else 0.5 * (lc.t_min + lc.t_max)
    shape = LearnerShape(ranks=lc.num_workers, dtype=lc.dtype, backend=lc.backend, zero_stage=lc.zero_stage,
                         offload_optimizer=lc.offload_optimizer, offload_param=lc.offload_param,
                         reference_copy=lc.kl_beta > 0 and not lc.lora.enabled, rows=rows, row_len=row_len,
                         response_len=max_new, draws_per_forward=draws, packed=lc.packed,
                         mask_fraction=mask_fraction, checkpointing=lc.gradient_checkpointing)
    learner = learner_memory(config, shape, profile)
    rc = cfg.rollout
    check_rollout_layout(rc, config)
    roll_seqs = math.ceil(batch / max(1, rc.num_workers))
    rollout = rollout_memory(config, rc.fp8, roll_seqs, seq, K, rc.tensor_parallel, rc.expert_parallel,
                             seq - max_new)
    learner_gpus = lc.num_workers * max(cfg.ray.learner_gpus, 0)
    # ray.rollout_gpus is per rank: a worker of tp x ep ranks holds that many GPUs times its ranks
    rollout_gpus = rc.num_workers * rollout["ranks"] * max(cfg.ray.rollout_gpus, 0)
    ranks_per_node = math.ceil(lc.num_workers / nodes)
    return {
        "model": {"spec": cfg.model, "parameters": count_parameters(config),
                  "block_routing_capacity": config.block_routing_capacity
                  if block_routing_active(config.block_routing_capacity, config.num_experts) else 0},
        "cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node, "gpu_mem_gb": gpu_mem_gb,
                    "gpus": nodes * gpus_per_node, "gpus_asked": learner_gpus + rollout_gpus},
        "learner": {**learner, "ranks": lc.num_workers, "micro_batch_rows": rows, "row_len": row_len,
                    "draws_per_forward": draws, "host_per_node": learner["host_per_rank"] * ranks_per_node},
        "rollout": {**rollout, "workers": rc.num_workers, "sequences": roll_seqs, "seq_len": seq},
    }


def format_plan(p: dict) -> str:
    """The plan as a table, GB per GPU."""
    gb = p["cluster"]["gpu_mem_gb"]
    lrn, rol, params = p["learner"], p["rollout"], p["model"]["parameters"]
    lines = [f"model {p['model']['spec']}: {params['total'] / 1e9:.2f} B parameters ({params['active'] / 1e9:.2f} B "
             f"active); cluster {p['cluster']['nodes']} x {p['cluster']['gpus_per_node']} GPUs of {gb:g} GB, "
             f"recipe asks for {p['cluster']['gpus_asked']:g} GPUs",
             "",
             f"learner rank (x{lrn['ranks']}): micro-batch of {lrn['micro_batch_rows']} rows x {lrn['row_len']} "
             f"tokens, {lrn['draws_per_forward']} draw(s) per forward -> {lrn['forward_rows']} x "
             f"{lrn['forward_row_len']} tokens, {lrn['scored_tokens']} scored",
             f"  {'weights':<22}{lrn['weights'] / GB:>9.1f} GB",
             f"  {'gradients':<22}{lrn['grads'] / GB:>9.1f} GB",
             f"  {'optimizer states':<22}{lrn['optimizer'] / GB:>9.1f} GB",
             f"  {'ZeRO-3 gather':<22}{lrn['zero3_gather'] / GB:>9.1f} GB",
             f"  {'reference model':<22}{lrn['reference'] / GB:>9.1f} GB",
             f"  {'activations':<22}{lrn['activations'] / GB:>9.1f} GB",
             f"  {'total':<22}{lrn['total'] / GB:>9.1f} GB  {'fits' if lrn['total'] <= gb * GB else 'DOES NOT FIT'}",
             f"  host RAM for offloaded states: {lrn['host_per_rank'] / GB:.1f} GB per rank, "
             f"{lrn['host_per_node'] / GB:.1f} GB per node",
             "",
             f"rollout worker (x{rol['workers']}): {rol['sequences']} sequences of {rol['seq_len']} tokens"
             + (f"; {rol['ranks']} ranks (tensor_parallel {rol['tensor_parallel']}, expert_parallel "
                f"{rol['expert_parallel']}), {rol['kv_heads_per_rank']} KV head(s) per rank"
                if rol["ranks"] > 1 else ""),
             f"  {'weights':<22}{rol['weights'] / GB:>9.1f} GB",
             f"  {'KV cache':<22}{rol['kv_cache'] / GB:>9.1f} GB",
             f"  {'block logits':<22}{rol['logits'] / GB:>9.1f} GB",
             *([f"  {'all-to-all buffers':<22}{rol['all_to_all'] / GB:>9.1f} GB"] if rol["expert_parallel"] > 1
               else []),
             f"  {'total':<22}{rol['total'] / GB:>9.1f} GB  {'fits' if rol['total'] <= gb * GB else 'DOES NOT FIT'}",
             f"  routed experts per decode forward: <= {rol['experts_per_block']} per block"
             f"{' (block routing)' if p['model'].get('block_routing_capacity') else ''}, <= "
             f"{rol['experts_per_forward']} per MoE layer over {rol['sequences']} active blocks, "
             f"{rol['expert_bytes_per_forward'] / GB:.2f} GB of expert weights read (one block alone: "
             f"{rol['expert_bytes_per_block'] / GB:.2f} GB)"
             + (f", over the worker's {rol['ranks']} ranks" if rol["ranks"] > 1 else "")]
    if rol["ranks"] > p["cluster"]["gpus_per_node"]:
        lines.append(f"\nnote: a rollout worker's {rol['ranks']} ranks span more than one node of "
                     f"{p['cluster']['gpus_per_node']} GPUs (its collectives cross the network)")
    if p["cluster"]["gpus_asked"] > p["cluster"]["gpus"]:
        lines.append(f"\nthe recipe asks for {p['cluster']['gpus_asked']:g} GPUs; the cluster has {p['cluster']['gpus']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow the options
    from ebpo.rl.config import RLConfig

    try:
        cfg = load_config(RLConfig, args.recipe, args.overrides)
        result = plan(cfg, args.gpus_per_node, args.gpu_mem_gb, args.nodes)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"ebpo plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    fits = (result["learner"]["total"] <= args.gpu_mem_gb * GB and result["rollout"]["total"] <= args.gpu_mem_gb * GB
            and result["cluster"]["gpus_asked"] <= result["cluster"]["gpus"])
    return 0 if fits else 1
