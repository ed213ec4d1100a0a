"""EBPOLearner: toy-reward learning, the on-policy step, config validation, save/load, LoRA, DeepSpeed.

The separate old pass and the off-policy update are checked in test_learner_update.py."""
import copy

import pytest
import torch

from ebpo.core.algos import compute_advantages, ebpo_loss
from ebpo.infra.config import ConfigError, build
from ebpo.rl.learner import EBPOLearner, LearnerConfig, lr_factor
from ebpo.rl.learner_config import LearnerLora
from ebpo.core.likelihood import all_composites, draw_noise, response_mask_from_ids

EOS, MASK = 1, 2


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


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="learner.n_draws"):
        LearnerConfig(n_draws=0).validate()
    with pytest.raises(ValueError, match="learner.total_steps"):
        LearnerConfig(schedule="cosine", total_steps=0).validate()
    with pytest.raises(ConfigError, match="learner.schedule"):
        build(LearnerConfig, {"schedule": "linear"}, "learner.")
    with pytest.raises(ConfigError, match="learner.eps_low"):
        build(LearnerConfig, {"eps_low": 1.5}, "learner.")
    with pytest.raises(ConfigError, match="learner.noise"):
        build(LearnerConfig, {"noise": "uniform"}, "learner.")


def test_lr_schedule_shape():
    cfg = LearnerConfig(warmup_steps=2, total_steps=10, schedule="cosine")
    assert lr_factor(1.0, cfg) == pytest.approx(0.5)
    assert lr_factor(2.0, cfg) == pytest.approx(1.0)
    assert lr_factor(6.0, cfg) == pytest.approx(0.5)
    assert lr_factor(10.0, cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(0.0, cfg, 0.5) == pytest.approx(0.25)  # first step of the first update: non-zero
    assert lr_factor(5.0, LearnerConfig()) == 1.0


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


def test_learner_betas_is_a_deprecated_alias_of_beta1_beta2():
    with pytest.warns(DeprecationWarning, match="learner.beta1"):
        cfg = build(LearnerConfig, {"betas": [0.8, 0.95]}, "learner.")
    assert (cfg.beta1, cfg.beta2, cfg.betas) == (0.8, 0.95, None)
    assert (LearnerConfig().beta1, LearnerConfig().beta2) == (0.9, 0.999)  # the RL defaults are unchanged


def test_rl_and_sft_share_one_lr_schedule():
    from ebpo.core.schedule import lr_schedule
    from ebpo.rl.learner_config import lr_factor

    cfg = LearnerConfig(warmup_steps=2, total_steps=10, schedule="cosine")
    for p in (0.0, 0.5, 1.0, 2.0, 6.0, 9.5, 12.0):
        assert lr_factor(p, cfg, 0.5) == lr_schedule(p, 0.5, 2, 10, "cosine")


def test_learner_lora_is_the_sft_section_and_the_old_mapping_is_a_deprecated_alias():
    from ebpo.sft.config import LoraSection

    assert issubclass(LearnerLora, LoraSection)  # one spelling: enabled, r, alpha, dropout, target_modules
    assert build(LearnerConfig, {}, "learner.").lora.enabled is False
    assert build(LearnerConfig, {"lora": None}, "learner.").lora.enabled is False  # ebpo 0.1: null = off
    cfg = build(LearnerConfig, {"lora": {"enabled": True, "r": 4}}, "learner.")
    assert (cfg.lora.enabled, cfg.lora.r, cfg.lora.alpha) == (True, 4, 16.0)  # the RL defaults otherwise
    with pytest.warns(DeprecationWarning, match="learner.lora.enabled"):
        old = build(LearnerConfig, {"lora": {"r": 4, "alpha": 8}}, "learner.")  # ebpo 0.1: a mapping = on
    assert (old.lora.enabled, old.lora.r, old.lora.alpha) == (True, 4, 8.0)
    with pytest.raises(ConfigError, match="learner.lora.r"):
        build(LearnerConfig, {"lora": {"enabled": True, "r": 0}}, "learner.")
