"""A data-parallel learner group: W ranks (processes with a gloo group) compute the update of one rank on
the whole batch. Each variant runs in fresh processes (`torch.multiprocessing.spawn`) so that no default
process group leaks into the test process; the reference is the same code at W = 1 with no token budget."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.models import small_lm


def _batch(model, B=8, seed=1):
    """Prompts of 3-6 tokens and responses of 1-24 tokens (lengths 8x apart), right-padded with EOS."""
    g = torch.Generator().manual_seed(seed)
    eos = model.config.eos_token_id
    resp_lens = [1, 24, 3, 20, 2, 12, 6, 16][:B]
    prompt_lens = torch.randint(3, 7, (B,), generator=g)
    L = int(max(p + r for p, r in zip(prompt_lens.tolist(), resp_lens))) + 2
    ids = torch.full((B, L), eos, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens.tolist(), resp_lens)):
        ids[i, : p + r] = torch.randint(0, eos, (p + r,), generator=g)
        ids[i, p + r - 1] = eos  # the response ends with EOS
    adv = torch.randn(B, generator=g)
    return {"input_ids": ids, "prompt_lens": prompt_lens, "advantages": adv}


def _worker(rank, world, port, fields, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    learner = EBPOLearner(small_lm(), LearnerConfig(num_workers=world, **fields))
    batch = _batch(learner.get_model() if fields.get("backend") != "deepspeed" else small_lm())
    adam = _track_adam_sensitivity(learner)
    metrics = [learner.update(batch) for _ in range(2)]
    state = {k: v.float() for k, v in learner.state_dict_for_sync().items()}
    if rank == 0:
        torch.save({"state": state, "metrics": metrics, "adam": adam}, out_path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _track_adam_sensitivity(learner):
    """Accumulate, per weight, sum over optimizer steps of 1 / (sqrt(v_hat_t) + eps): how much Adam's steps
    move per unit of gradient change at each step (a weight whose gradient was near zero at any one step is
    sensitive then, whatever its later size), and per tensor the largest gradient RMS. Returns the dict the
    hook fills; None for DeepSpeed (sharded)."""
    if learner.engine is not None:
        return None
    names = {id(p): n for n, p in learner.model.named_parameters()}
    acc = {"sensitivity": {}, "rms_max": {}, "steps": 0}

    def after_step(optimizer, args, kwargs):
        for p, st in optimizer.state.items():
            n, t = names[id(p)], int(st["step"])
            rms = (st["exp_avg_sq"] / (1 - learner.cfg.beta2 ** t)).sqrt().float()
            # a weight no token has touched yet has no terms to reorder: zero in every run, no sensitivity
            acc["sensitivity"][n] = acc["sensitivity"].get(n, 0) + torch.where(rms > 0, 1 / (rms + ADAM_EPS), 0.0)
            acc["rms_max"][n] = max(acc["rms_max"].get(n, 0.0), float(rms.max()))
            acc["steps"] = t

    learner.optimizer.register_step_post_hook(after_step)
    return acc


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(world, fields, tmp_path, name):
    out = tmp_path / f"{name}.pt"
    mp.spawn(_worker, args=(world, _free_port(), fields, str(out)), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


# bernoulli noise; the weights are compared within what reduction order can change through Adam
# (`_weight_tolerance`), which also holds under ATEN_CPU_CAPABILITY=default / avx2 and one thread.
BASE = dict(lr=1e-2, n_draws=2, mu=2, minibatch_size=4, seed=3, kl_beta=0.0, noise="bernoulli")


FP32_EPS = torch.finfo(torch.float32).eps
# terms summed into one gradient element: batch rows x the longest padded row (6 + 24 + 2) x noise draws
BATCH_TOKENS = 8 * 32 * BASE["n_draws"]
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the learner keeps


def _weight_tolerance(ref, name, v, lr):
    """Per-weight tolerance of two runs whose gradients differ only by fp32 reduction order.

    A gradient element is a sum of per-token terms; summing N of them in another order moves it by about
    sqrt(N) * eps32 * S (rounding errors of a sum add up like a random walk: the probabilistic bound of
    Higham and Mary, 2019), S the size of the terms, taken here as the largest gradient RMS Adam saw in the
    tensor, and N the batch's token count. Adam turns a gradient change d
    at step t into a step change of about lr * d / (sqrt(v_hat_t) + eps): negligible for a weight with a real
    gradient, up to the whole step for one whose gradient sat at the noise floor at some step (its direction
    was decided by rounding). So each weight may differ by 1% of a step plus that amplified noise summed over
    the steps, never more than 2 steps per step.
    """
    base = 0.01 * lr + 1e-5 * v.abs()
    adam = ref.get("adam")
    if adam is None or name not in adam["sensitivity"]:  # DeepSpeed, or a buffer Adam does not step
        return base
    noise = BATCH_TOKENS ** 0.5 * FP32_EPS * adam["rms_max"][name]
    amplified = (lr * noise * adam["sensitivity"][name]).clamp(max=2 * lr * adam["steps"])
    return base + amplified


def _assert_same_update(a, b):
    """Same weights, within what fp32 reduction order can change through Adam (`_weight_tolerance`), and same
    metrics; the gradient norm catches a normalisation error, which Adam alone would hide (it is scale
    invariant)."""
    lr = BASE["lr"]
    for k, v in a["state"].items():
        diff = (v - b["state"][k]).abs()
        tol = _weight_tolerance(a, k, v, lr)
        assert (diff <= tol).all(), (k, diff.max(), (diff - tol).max())
    for ma, mb in zip(a["metrics"], b["metrics"]):
        for k in ("actor/pg_loss", "actor/log_ratio_mean", "actor/grad_norm", "likelihood/elbo_seq_mean",
                  "likelihood/block_per_token_mean"):
            assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-5), k


@pytest.mark.parametrize("budget", [0, 48])
def test_two_ranks_equal_one_rank_torch_backend(tmp_path, budget):
    one = run_group(1, BASE, tmp_path, "w1")
    two = run_group(2, {**BASE, "max_tokens_per_microbatch": budget}, tmp_path, f"w2_{budget}")
    _assert_same_update(one, two)


def test_token_budget_alone_gives_the_same_update(tmp_path):
    one = run_group(1, BASE, tmp_path, "w1")
    micro = run_group(1, {**BASE, "max_tokens_per_microbatch": 24}, tmp_path, "w1_micro")
    _assert_same_update(one, micro)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_equal_one_rank_deepspeed(tmp_path, stage):
    pytest.importorskip("deepspeed")
    fields = {**BASE, "backend": "deepspeed", "zero_stage": stage}
    one = run_group(1, fields, tmp_path, f"ds{stage}_w1")
    two = run_group(2, {**fields, "max_tokens_per_microbatch": 48}, tmp_path, f"ds{stage}_w2")
    _assert_same_update(one, two)


def test_bf16_first_step_ratio_is_exactly_one_and_finite():
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    model = small_lm()
    learner = EBPOLearner(model, LearnerConfig(dtype="bf16", lr=1e-12, n_draws=2, mu=2, minibatch_size=4, seed=0))
    try:
        m = learner.update(_batch(model))
    except RuntimeError as e:
        # torch's bf16 GEMM packs for the AVX-512 it finds on the CPU, then refuses because ATEN_CPU_CAPABILITY
        # forbids AVX-512: a forced combination no CPU has (an AVX2-only CPU takes another path)
        if "pack_vnni2" in str(e) and os.environ.get("ATEN_CPU_CAPABILITY") in ("default", "avx2"):
            pytest.skip(f"bf16 GEMM under a forced ATEN_CPU_CAPABILITY below the CPU's own: {e}")
        raise
    assert m["actor/log_ratio_mean"] == 0.0 and m["actor/log_ratio_max"] == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gradient_checkpointing_gives_the_same_update():
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    states = []
    for ckpt in (False, True):
        model = small_lm()
        learner = EBPOLearner(model, LearnerConfig(gradient_checkpointing=ckpt, **BASE))
        assert getattr(model, "is_gradient_checkpointing", False) == ckpt
        m = learner.update(_batch(model))
        states.append(({k: v.clone() for k, v in model.state_dict().items()}, m))
    (a, ma), (b, mb) = states
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
