"""`ebpo plan`'s arithmetic: parameters counted on the meta device equal the real model's, and the probed
activation estimate matches the bytes the tiny model really saves for the backward in a learner forward
(CPU, fp32 and bf16, several batch shapes)."""
import os
import pytest
import torch

from ebpo.core.likelihood import composite_logprobs, draw_noise, response_mask_from_ids
from ebpo.infra.memory_plan import (LearnerShape, count_parameters, learner_memory, probe_activations,
                                    saved_tensor_bytes)
from ebpo.model import LLaDA2MoeModelLM
from ebpo.model.presets import load_preset


def test_parameter_count_equals_the_built_model():
    config = load_preset("tiny")
    model = LLaDA2MoeModelLM(config)
    assert count_parameters(config)["total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,length,draws", [(4, 64, 2), (1, 256, 1), (2, 384, 3)])
def test_activation_estimate_matches_the_tiny_models_saved_bytes(dtype, rows, length, draws):
    config = load_preset("tiny")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaDA2MoeModelLM(config).to(dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size - 10, (rows, length), generator=g)
    resp = response_mask_from_ids(ids, torch.full((rows,), 8), config.eos_token_id)
    noise = draw_noise(resp, config.block_size, draws, 0.1, 1.0, g, form="exact_elbo")
    try:
        measured = saved_tensor_bytes(lambda: composite_logprobs(model, ids, noise, list(range(draws)),
                                                                 config.mask_token_id, packed=True))
    except RuntimeError as e:
        # torch's bf16 kernels pack for the AVX-512 they find on the CPU, then refuse because
        # ATEN_CPU_CAPABILITY forbids AVX-512: a forced combination no real CPU has
        if "pack_vnni2" in str(e) and os.environ.get("ATEN_CPU_CAPABILITY") in ("default", "avx2"):
            pytest.skip(f"bf16 under a forced ATEN_CPU_CAPABILITY below the CPU's own: {e}")
        raise
    estimate = probe_activations(config, dtype).saved_bytes(rows, (draws + 1) * length, int(noise.masked.sum()))
    assert 0.95 <= estimate / measured <= 1.10, (estimate, measured)


def test_zero3_shards_states_and_offload_moves_them_to_the_host():
    config = load_preset("tiny")
    P = count_parameters(config)["total"]
    base = dict(dtype="bf16", backend="deepspeed", offload_param=False, reference_copy=False, rows=1,
                row_len=64, response_len=32, draws_per_forward=1, packed=True, mask_fraction=0.5,
                checkpointing=False)
    one = learner_memory(config, LearnerShape(ranks=1, zero_stage=3, offload_optimizer=False, **base))
    four = learner_memory(config, LearnerShape(ranks=4, zero_stage=3, offload_optimizer=False, **base))
    off = learner_memory(config, LearnerShape(ranks=4, zero_stage=3, offload_optimizer=True, **base))
    assert one["weights"] == 2 * P and one["grads"] == 2 * P and one["optimizer"] == 12 * P
    assert four["weights"] == P / 2 and four["optimizer"] == 3 * P
    assert off["optimizer"] == 0 and off["host_per_rank"] == 3 * P
    ckpt = learner_memory(config, LearnerShape(ranks=1, zero_stage=3, offload_optimizer=False,
                                               **{**base, "checkpointing": True, "row_len": 4096}))
    full = learner_memory(config, LearnerShape(ranks=1, zero_stage=3, offload_optimizer=False,
                                               **{**base, "row_len": 4096}))
    assert ckpt["activations"] < full["activations"] / 2


def test_plan_command_for_the_mini_recipe(capsys):
    from ebpo.cli import main

    assert main(["plan", "recipes/rl_math_llada21_mini.yaml", "model=preset:mini"]) == 0
    out = capsys.readouterr().out
    assert "16.26 B parameters" in out and "DOES NOT FIT" not in out
    # flash on one node of 80 GB GPUs does not fit: exit status 1
    assert main(["plan", "recipes/rl_math_llada21_mini.yaml", "model=preset:flash"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_block_routing_bounds_the_expert_working_set():
    from ebpo.infra.memory_plan import expert_working_set, rollout_memory

    off, on = load_preset("mini"), load_preset("llada22_mini")
    assert on.block_routing_capacity == 48
    per_expert = 3 * off.hidden_size * off.moe_intermediate_size * 19 * 2  # 19 MoE layers, bf16
    a, b = expert_working_set(off, 1, 32, 2), expert_working_set(on, 1, 32, 2)
    assert (a["experts_per_block"], b["experts_per_block"]) == (256, 48)  # 32 tokens x 8 > 256; C = 48
    assert b["bytes_per_block"] == 48 * per_expert and a["bytes_per_block"] == 256 * per_expert
    assert expert_working_set(on, 3, 32, 2)["experts_per_layer"] == 144
    assert expert_working_set(on, 9, 32, 2)["experts_per_layer"] == 256
    assert expert_working_set(load_preset("tiny"), 1, 8, 2)["experts_per_block"] == 8
    r = rollout_memory(on, False, 2, 64, 32)
    assert r["experts_per_forward"] == 96 and r["total"] == rollout_memory(off, False, 2, 64, 32)["total"]


def test_activation_probe_runs_with_block_routing():
    cfg = load_preset("tiny", block_routing_capacity=3)
    prof = probe_activations(cfg, torch.float32)  # the pool is chosen without grad: no extra saved tensors
    off = probe_activations(load_preset("tiny"), torch.float32).per_token
    assert 0.9 * off <= prof.per_token <= 1.1 * off
