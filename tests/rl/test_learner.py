"""The EBPO learner (ebpo.rl.learner): toy-reward learning, the on-policy step, save/load, LoRA, DeepSpeed, and
`EBPOLearner.update` against references that share none of its code paths.

* the separate old pass (mu > 1 or several minibatches) at a vanishing learning rate: log-ratio exactly 0;
* the off-policy update (mu = 2, three minibatches) against a hand-written PPO/AdamW loop that scores
  each block by its own forward (no `all_composites`, no `ebpo_loss`, no `torch.optim`);
* the `likelihood/*` metrics against a plain loop;
* the KL penalty at -100 nats and non-finite steps: no NaN reaches the weights."""
import copy
import math

import pytest
import torch

from ebpo.core.algos import compute_advantages, ebpo_loss, kl_estimate
from ebpo.core.likelihood import all_composites, draw_noise, response_mask_from_ids
from ebpo.rl.learner import EBPOLearner, LearnerConfig
from ebpo.rl.learner_config import LearnerLora

EOS, MASK = 1, 2


def six_batch():
    """Three prompts x two responses of different lengths (some end inside a block, one spans 4 blocks)."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    responses = [[[20, 21, 22, 23, 24, EOS], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, EOS]],
                 [[40, 41, 42, EOS], [50, 51, 52, 53, 54, 55, EOS]],
                 [[60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, EOS], [80, EOS]]]
    rows = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    L = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), L), EOS, dtype=torch.long)
    resp = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        resp[i, len(p): len(p) + len(r)] = True
    adv = torch.tensor([1.0, -1.0, -0.7, 0.7, 1.2, -1.2])
    return {"input_ids": ids, "prompt_lens": torch.tensor([len(p) for p, _ in rows]), "response_mask": resp,
            "advantages": adv, "group_ids": torch.arange(3).repeat_interleave(2)}


def block_terms(model, ids_row, masked, weight, K):
    """Per-block terms [(block index, (1/t) sum of log p over the block's masked tokens)] of one draw."""
    out = []
    L = ids_row.shape[0]
    for b0 in range(0, L, K):
        m = masked[b0:b0 + K]
        if not m.any():
            continue
        block = ids_row[b0:b0 + K].clone()
        block[m] = MASK
        x = torch.cat([ids_row[:b0], block])[None]
        logp = model(x).logits[0, b0:].float().log_softmax(-1)  # the model's default mask is block-causal
        js = m.nonzero().flatten()
        out.append((b0 // K, (logp[js, ids_row[b0 + js]] * weight[b0 + js]).sum()))
    return out


def plain_composites(model, ids, noise, rows):
    """C (len(rows), N): sum over blocks of one draw's terms, each block scored by its own forward."""
    K, N = noise.block_size, noise.n_draws
    return torch.stack([torch.stack([sum(v for _, v in block_terms(model, ids[i], noise.masked[n, i],
                                                                   noise.weight[n, i], K))
                                     for n in range(N)]) for i in rows])


def textbook_ppo_loss(cur, old, adv, eps_low, eps_high, dual):
    log_rho = (cur - old).mean(1)
    rho = log_rho.exp()
    obj = torch.minimum(rho * adv, rho.clamp(1 - eps_low, 1 + eps_high) * adv)
    obj = torch.where(adv < 0, torch.maximum(obj, dual * adv), obj)
    clip_low = ((adv < 0) & (rho < 1 - eps_low)).float().mean()
    clip_high = ((adv >= 0) & (rho > 1 + eps_high)).float().mean()
    clip_dual = ((adv < 0) & (rho > dual)).float().mean()
    return -obj.mean(), log_rho.detach(), (float(clip_low), float(clip_high), float(clip_dual))


class PlainAdamW:
    """AdamW written out (torch's update: m/(1-b1^t) / (sqrt(v)/sqrt(1-b2^t) + eps)), weight decay 0."""

    def __init__(self, params, lr, betas, eps=1e-8):
        self.params, self.lr, (self.b1, self.b2), self.eps = list(params), lr, betas, eps
        self.state = {}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            s = self.state.setdefault(p, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            s["t"] += 1
            s["m"] = self.b1 * s["m"] + (1 - self.b1) * p.grad
            s["v"] = self.b2 * s["v"] + (1 - self.b2) * p.grad * p.grad
            m_hat = s["m"] / (1 - self.b1 ** s["t"])
            denom = s["v"].sqrt() / math.sqrt(1 - self.b2 ** s["t"]) + self.eps
            p -= self.lr * m_hat / denom
            p.grad = None


def clip_grads(params, max_norm):
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coef)
    return norm


@pytest.mark.parametrize("noise", ["bernoulli", "exact_elbo"])
@pytest.mark.parametrize("packed,cached,replay,mu,mbs,budget", [
    (True, True, True, 2, 0, 0),      # mu = 2 over one minibatch
    (True, True, True, 1, 2, 0),      # one epoch, three minibatches
    (True, False, True, 2, 2, 0),     # packed no-grad pass
    (False, False, True, 2, 2, 0),    # unpacked
    (False, False, False, 2, 2, 0),   # direct backprop
    (True, True, True, 2, 2, 24),     # token-budget micro-batches
])
def test_separate_old_pass_gives_log_ratio_exactly_zero(small_model, noise, packed, cached, replay, mu, mbs, budget):
    """The old composites come from their own no-grad pass; at a vanishing learning rate the weights do not
    move, so every step's current composites must equal them bit for bit: log-ratio exactly 0, no clip.
    Misaligned rows, different draws or a different scoring path for old and current would all show."""
    batch = six_batch()
    cfg = LearnerConfig(lr=1e-30, n_draws=3, mu=mu, minibatch_size=mbs, packed=packed, nograd_cached=cached,
                        grad_replay=replay, max_tokens_per_microbatch=budget, noise=noise, seed=4)
    learner = EBPOLearner(copy.deepcopy(small_model), cfg)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    m = learner.update(batch)
    assert m["timing_s/old_logprob"] > 0, "the separate old pass must run"
    assert m["actor/log_ratio_mean"] == 0.0 and m["actor/log_ratio_max"] == 0.0
    assert m["actor/clipfrac_low"] == m["actor/clipfrac_high"] == m["actor/clipfrac_dual"] == 0.0
    assert m["actor/grad_norm"] > 0 and m["actor/nonfinite_steps"] == 0
    after = learner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "lr 1e-30 must leave the weights as they were"


@pytest.mark.parametrize("noise", ["bernoulli", "exact_elbo"])
def test_off_policy_update_matches_hand_written_ppo_adamw(small_model, noise):
    """mu = 2 epochs over three minibatches of two sequences: six optimizer steps, the last five off-policy."""
    batch = six_batch()
    cfg = LearnerConfig(lr=3e-3, n_draws=2, mu=2, minibatch_size=2, grad_clip=0.5, eps_low=0.1, eps_high=0.1,
                        dual_clip=1.5, noise=noise, seed=11)
    learner = EBPOLearner(copy.deepcopy(small_model), cfg)
    m = learner.update(batch)

    ref = copy.deepcopy(small_model).train()
    ids, resp, adv = batch["input_ids"], batch["response_mask"], batch["advantages"]
    K = ref.config.block_size
    gen = torch.Generator().manual_seed(cfg.seed)  # the learner's draws: noise, minibatch split, epoch orders
    noise_draws = draw_noise(resp, K, cfg.n_draws, cfg.t_min, cfg.t_max, gen, form=noise)
    minibatches = torch.randperm(6, generator=gen).split(2)
    with torch.no_grad():
        old = plain_composites(ref, ids, noise_draws, range(6))
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = PlainAdamW(params, cfg.lr, (cfg.beta1, cfg.beta2))
    steps = []
    for _ in range(cfg.mu):
        for j in torch.randperm(3, generator=gen).tolist():
            rows = minibatches[j].tolist()
            cur = plain_composites(ref, ids, noise_draws, rows)
            loss, log_rho, clips = textbook_ppo_loss(cur, old[rows], adv[rows], cfg.eps_low, cfg.eps_high,
                                                     cfg.dual_clip)
            loss.backward()
            norm = clip_grads(params, cfg.grad_clip)
            opt.step()
            steps.append((float(loss.detach()), float(log_rho.abs().max()), clips, norm))

    n = len(steps)
    assert n == 6
    assert m["actor/pg_loss"] == pytest.approx(sum(s[0] for s in steps) / n, rel=1e-3, abs=1e-5)
    assert m["actor/log_ratio_max"] == pytest.approx(max(s[1] for s in steps), rel=1e-3, abs=1e-5)
    assert m["actor/grad_norm"] == pytest.approx(sum(s[3] for s in steps) / n, rel=1e-3)
    for i, key in enumerate(("clipfrac_low", "clipfrac_high", "clipfrac_dual")):
        assert m[f"actor/{key}"] == pytest.approx(sum(s[2][i] for s in steps) / n, abs=1e-9), key
    assert sum(sum(s[2]) for s in steps) > 0, "the reference must exercise the clip"
    assert max(s[1] for s in steps) > 0.05, "later steps must be off-policy"
    for (name, p), q in zip(learner.model.named_parameters(), ref.parameters()):
        # six Adam steps: elements with near-zero gradients amplify float noise of the two summation
        # orders (Adam divides by sqrt(v) ~ |g|), so the tolerance is a fraction of one step, not 1e-7
        torch.testing.assert_close(p, q, atol=0.05 * cfg.lr, rtol=0, msg=name)
    moved = max(float((p - q0).abs().max()) for p, q0 in zip(ref.parameters(), small_model.parameters()))
    assert moved > 3 * cfg.lr


@pytest.mark.parametrize("noise", ["bernoulli", "exact_elbo"])
@pytest.mark.parametrize("mu,mbs", [(1, 0), (2, 2)])  # on-policy shortcut, separate old pass
def test_likelihood_metrics_match_plain_loop(small_model, mu, mbs, noise):
    batch = six_batch()
    cfg = LearnerConfig(lr=1e-3, n_draws=3, mu=mu, minibatch_size=mbs, seed=9, noise=noise)
    learner = EBPOLearner(copy.deepcopy(small_model), cfg)
    m = learner.update(batch)

    ids, resp = batch["input_ids"], batch["response_mask"]
    K = small_model.config.block_size
    noise = draw_noise(resp, K, cfg.n_draws, cfg.t_min, cfg.t_max, torch.Generator().manual_seed(cfg.seed),
                       form=cfg.noise)
    per_token_blocks, seq, per_token_seq = [], [], []
    with torch.no_grad():
        for i in range(ids.shape[0]):
            sums = {}
            for n in range(cfg.n_draws):
                for b, v in block_terms(small_model, ids[i], noise.masked[n, i], noise.weight[n, i], K):
                    sums[b] = sums.get(b, 0.0) + float(v) / cfg.n_draws
            for b, v in sums.items():
                per_token_blocks.append(v / int(resp[i, b * K:(b + 1) * K].sum()))
            seq.append(sum(sums.values()))
            per_token_seq.append(seq[-1] / int(resp[i].sum()))
    tol = dict(rel=1e-4, abs=1e-4)
    assert m["likelihood/block_per_token_mean"] == pytest.approx(sum(per_token_blocks) / len(per_token_blocks), **tol)
    assert m["likelihood/block_per_token_min"] == pytest.approx(min(per_token_blocks), **tol)
    assert m["likelihood/block_per_token_max"] == pytest.approx(max(per_token_blocks), **tol)
    assert m["likelihood/elbo_seq_mean"] == pytest.approx(sum(seq) / len(seq), **tol)
    assert m["likelihood/elbo_per_token_mean"] == pytest.approx(sum(per_token_seq) / len(seq), **tol)
    assert m["likelihood/blocks_per_seq"] == pytest.approx(len(per_token_blocks) / len(seq))


def test_k3_is_bounded_below_minus_20_nats_and_exact_above():
    d = torch.tensor([-100.0, -88.5, -25.0, -20.0, -5.0, 0.0, 3.0, 100.0], requires_grad=True)
    k3 = kl_estimate(d, "k3")
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(d.grad).all()
    plain = torch.expm1(-d.detach()) + d.detach()
    assert not torch.isfinite(plain[:2]).all()  # what the unbounded form gave
    above = d.detach() >= -20
    assert torch.allclose(k3.detach()[above], plain[above], rtol=1e-6)
    c = 20.0
    tangent = (math.exp(c) - 1 - c) + (1 - math.exp(c)) * (d.detach()[~above] + c)
    assert torch.allclose(k3.detach()[~above], tangent, rtol=1e-6)
    assert torch.allclose(d.grad[~above], torch.full_like(d.grad[~above], 1 - math.exp(c)), rtol=1e-6)
    assert (k3.detach() >= 0).all()


def drift(model, scale):
    """Multiply the LM head in place: the policy's log-probs of the batch fall by tens of nats per block."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)


def test_kl_penalty_at_minus_100_nats_keeps_weights_finite(small_model):
    batch = six_batch()
    learner = EBPOLearner(copy.deepcopy(small_model), LearnerConfig(lr=1e-3, n_draws=2, kl_beta=0.1, seed=1))
    drift(learner.model, 40.0)  # policy drifted far from the frozen reference (the initial weights)
    # the learner's draws (its generator's first use): log pi - log pi_ref far below -88 nats, where plain
    # k3 is inf, the loss inf and the gradient NaN
    noise = draw_noise(batch["response_mask"], 4, 2, 0.1, 1.0, torch.Generator().manual_seed(1),
                       form=learner.cfg.noise)
    with torch.no_grad():
        cur = plain_composites(learner.model, batch["input_ids"], noise, range(6)).mean(1)
        ref = plain_composites(learner.ref_model, batch["input_ids"], noise, range(6)).mean(1)
    assert (cur - ref).min() < -100
    m = learner.update(batch)
    assert math.isfinite(m["actor/kl"]) and m["actor/kl"] > 0 and math.isfinite(m["actor/grad_norm"])
    assert m["actor/nonfinite_steps"] == 0
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())


def test_nonfinite_loss_or_gradient_skips_the_step(small_model):
    batch = six_batch()
    cfg = LearnerConfig(lr=1e-3, n_draws=2, mu=1, minibatch_size=2, seed=2)  # three steps per update
    learner = EBPOLearner(copy.deepcopy(small_model), cfg)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    bad = dict(batch, advantages=batch["advantages"].clone())
    bad["advantages"][:] = float("nan")  # every minibatch's loss is NaN
    m = learner.update(bad)
    assert m["actor/nonfinite_steps"] == 3
    after = learner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step must not touch the weights"
    assert not learner.optimizer.state, "nor Adam's moments"
    # a finite loss whose gradient is NaN: skipped too
    head = learner.model.get_output_embeddings().weight
    hook = head.register_hook(lambda g: g * float("nan"))
    m = learner.update(batch)
    hook.remove()
    assert m["actor/nonfinite_steps"] == 3 and math.isfinite(m["actor/pg_loss"])
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())
    m = learner.update(batch)  # and training goes on
    assert m["actor/nonfinite_steps"] == 0
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


def toy_batch():
    """Two prompts x two responses each; the first response of each prompt is rewarded."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    responses = [[[20, 21, 22, 23, 24, EOS], [30, 31, 32, 33, 34, 35, 36, EOS]],
                 [[40, 41, 42, EOS], [50, 51, 52, 53, 54, EOS]]]
    rows, groups, rewards = [], [], []
    for g, (p, rs) in enumerate(zip(prompts, responses)):
        for k, r in enumerate(rs):
            rows.append((p, r))
            groups.append(g)
            rewards.append(1.0 if k == 0 else 0.0)
    L = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), L), EOS, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
    group_ids = torch.tensor(groups)
    rewards = torch.tensor(rewards)
    return {"input_ids": ids, "prompt_lens": torch.tensor([len(p) for p, _ in rows]),
            "advantages": compute_advantages(rewards, group_ids), "group_ids": group_ids}, rewards


def elbo(model, batch, n=48, seed=123):
    """Composite log-likelihood estimate per sequence with many fixed draws (same draws every call)."""
    resp = response_mask_from_ids(batch["input_ids"], batch["prompt_lens"], EOS)
    nz = draw_noise(resp, model.config.block_size, n, 0.1, 1.0, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return all_composites(model, batch["input_ids"], nz, MASK, packed=True).mean(1)


def test_toy_reward_raises_likelihood_of_rewarded_responses(small_model):
    model = copy.deepcopy(small_model)
    batch, rewards = toy_batch()
    before = elbo(model, batch)
    learner = EBPOLearner(model, LearnerConfig(lr=3e-3, n_draws=4, mu=2, minibatch_size=2, grad_clip=1.0, seed=0))
    for _ in range(4):
        m = learner.update(batch)
    after = elbo(learner.get_model(), batch)
    delta = after - before
    assert (delta[rewards == 1] > 0).all(), delta
    assert (delta[rewards == 0] < 0).all(), delta
    for key in ("actor/pg_loss", "actor/clipfrac_low", "actor/clipfrac_high", "actor/clipfrac_dual",
                "actor/log_ratio_mean", "actor/log_ratio_max", "actor/kl", "actor/grad_norm", "actor/lr",
                "actor/nonfinite_steps",
                "timing_s/old_logprob",
                "timing_s/update", "likelihood/block_per_token_mean"):
        assert key in m


@pytest.mark.parametrize("packed,cached,replay", [(True, True, True), (False, False, False)])
def test_on_policy_update_matches_plain_reference(small_model, packed, cached, replay):
    """mu=1 over one minibatch skips the separate old pass; the step must equal the textbook one:
    old composites from a no-grad forward, the clipped surrogate, backward, clip, one AdamW step."""
    batch, _ = toy_batch()
    cfg = LearnerConfig(lr=1e-3, n_draws=3, mu=1, packed=packed, nograd_cached=cached, grad_replay=replay,
                        grad_clip=0.5, seed=7)
    learner = EBPOLearner(copy.deepcopy(small_model), cfg)
    m = learner.update(batch)

    ref = copy.deepcopy(small_model).train()
    ids = batch["input_ids"]
    resp = response_mask_from_ids(ids, batch["prompt_lens"], EOS)
    noise = draw_noise(resp, ref.config.block_size, 3, cfg.t_min, cfg.t_max, torch.Generator().manual_seed(7),
                       form=cfg.noise)
    with torch.no_grad():
        old = all_composites(ref, ids, noise, MASK, packed=False)
    cur = all_composites(ref, ids, noise, MASK, packed=False)
    loss, _ = ebpo_loss(cur, old, batch["advantages"], cfg.eps_low, cfg.eps_high, dual_clip=cfg.dual_clip)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
    torch.optim.AdamW(ref.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=0.0).step()

    assert m["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert m["likelihood/elbo_seq_mean"] == pytest.approx(float(old.mean()), rel=1e-5)
    for (name, p), q in zip(learner.get_model().named_parameters(), ref.parameters()):
        # Adam divides by sqrt(v) ~ |g|: elements with near-zero gradient amplify float-order noise of
        # the two summation orders, so the tolerance is 1% of one step (lr), not machine precision
        torch.testing.assert_close(p, q, atol=1e-2 * cfg.lr, rtol=0, msg=name)
    moved = max(float((p - q0).abs().max()) for p, q0 in zip(ref.parameters(), small_model.parameters()))
    assert moved > 0.5 * cfg.lr  # the step really moved the weights


def test_save_load_resumes_identically(small_model, tmp_path):
    batch, _ = toy_batch()
    cfg = LearnerConfig(lr=1e-3, n_draws=2, mu=1, minibatch_size=2, warmup_steps=3, total_steps=6,
                        schedule="cosine", seed=3)
    a = EBPOLearner(copy.deepcopy(small_model), cfg)
    a.update(batch)
    a.save(str(tmp_path / "ckpt"))
    ma = a.update(batch)
    b = EBPOLearner(copy.deepcopy(small_model), cfg)
    b.load(str(tmp_path / "ckpt"))
    mb = b.update(batch)
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/log_ratio_mean"):
        assert ma[k] == pytest.approx(mb[k], rel=1e-6, abs=1e-9), k
    sa, sb = a.state_dict_for_sync(), b.state_dict_for_sync()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_lora_sync_merges_adapter_and_reference_is_base(small_model):
    pytest.importorskip("peft")
    batch, _ = toy_batch()
    base = copy.deepcopy(small_model)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    learner = EBPOLearner(base, LearnerConfig(lr=1e-2, n_draws=2, kl_beta=0.1, lora=LearnerLora(enabled=True, r=4, alpha=8)))
    m = learner.update(batch)
    assert m["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # first step: policy == reference
    learner.update(batch)
    sync = learner.state_dict_for_sync()
    assert set(sync) == set(original)
    assert all(v.device.type == "cpu" for v in sync.values())
    changed = {k for k in sync if not torch.equal(sync[k], original[k])}
    assert "model.layers.0.attention.query_key_value.weight" in changed
    assert "model.word_embeddings.weight" not in changed and "lm_head.weight" not in changed
    assert "model.layers.1.mlp.experts.gate_proj" not in changed  # routed experts: no LoRA
    # Merged weights give the adapted model's outputs; the disabled adapter gives the base model's.
    merged = copy.deepcopy(small_model)
    merged.load_state_dict(sync)
    ids = batch["input_ids"]
    with torch.no_grad():
        adapted = learner.model(input_ids=ids).logits
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-4)
        with learner.model.disable_adapter():
            assert torch.allclose(learner.model(input_ids=ids).logits, small_model(ids).logits, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_torch_backend(small_model, stage):
    pytest.importorskip("deepspeed")
    batch, _ = toy_batch()
    cfg = dict(lr=1e-3, n_draws=3, mu=1, minibatch_size=2, grad_clip=0.5, seed=1)
    t = EBPOLearner(copy.deepcopy(small_model), LearnerConfig(**cfg))
    d = EBPOLearner(copy.deepcopy(small_model), LearnerConfig(backend="deepspeed", zero_stage=stage, **cfg))
    mt, md = t.update(batch), d.update(batch)
    assert md["actor/pg_loss"] == pytest.approx(mt["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert md["actor/grad_norm"] == pytest.approx(mt["actor/grad_norm"], rel=1e-3)
    st, sd = t.state_dict_for_sync(), d.state_dict_for_sync()
    assert set(st) == set(sd)
    for k in st:
        assert torch.allclose(st[k], sd[k], atol=1e-5), k


@pytest.mark.slow
def test_deepspeed_save_load_roundtrip(small_model, tmp_path):
    pytest.importorskip("deepspeed")
    batch, _ = toy_batch()
    cfg = LearnerConfig(backend="deepspeed", zero_stage=2, lr=1e-3, n_draws=2, mu=1, seed=2)
    a = EBPOLearner(copy.deepcopy(small_model), cfg)
    a.update(batch)
    a.save(str(tmp_path / "ds"))
    ma = a.update(batch)
    b = EBPOLearner(copy.deepcopy(small_model), cfg)
    b.load(str(tmp_path / "ds"))
    mb = b.update(batch)
    assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], rel=1e-6, abs=1e-9)
    sa, sb = a.state_dict_for_sync(), b.state_dict_for_sync()
    assert all(torch.allclose(sa[k], sb[k], atol=1e-7) for k in sa)
