"""Tensor- and expert-parallel LLaDA2-MoE for rollout workers that span several devices (docs/parallel.md).

    tp_group, ep_group = make_groups(tp=2, ep=4)           # after torch.distributed.init_process_group
    model = build_parallel_model(full_model_or_state_dict, config, tp_group, ep_group, fp8=False)
    out = model(input_ids, attention_mask=..., position_ids=..., cache=model.new_cache(B, max_len),
                cache_rows=rows, return_logits=False)        # LLaDA2MoeModelLM.forward's signature
    tok, prob = model.candidates(out.last_hidden_state[:, -K:], temperature, top_k, top_p, generators)
"""
from ebpo.model.parallel.layout import ParallelLayout, check_layout, layout_for, make_groups
from ebpo.model.parallel.model import ParallelLLaDA2MoeLM, build_parallel_model, shard_model
from ebpo.model.parallel.sampling import VocabShard, sharded_candidates, sharded_token_probs
from ebpo.model.parallel.sharding import ShardLoader, local_slice

__all__ = ["ParallelLayout", "ParallelLLaDA2MoeLM", "ShardLoader", "VocabShard", "build_parallel_model",
           "check_layout", "layout_for", "local_slice", "make_groups", "shard_model", "sharded_candidates",
           "sharded_token_probs"]
