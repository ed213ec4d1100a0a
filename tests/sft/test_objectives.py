"""ebpo.core.objectives: the vectorized [noisy ; clean] loss equals a per-block loop; MTF uses the model's own drafts."""
import torch
import torch.nn.functional as F

from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.core.noise import make_noisy, substitution_ids
from ebpo.core.objectives import ObjectiveConfig, mixture_loss, noisy_half_hidden

K = 4


def small_model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=K)
    return LLaDA2MoeModelLM(cfg).eval()


def per_block_logits(model, noisy, clean):
    """Reference: for each block b, run [clean blocks < b ; noisy block b] alone and keep block b's logits."""
    B, L = clean.shape
    out = torch.zeros(B, L, model.config.vocab_size)
    for s in range(0, L, K):
        e = min(s + K, L)
        x = torch.cat([clean[:, :s], noisy[:, s:e]], dim=1)
        logits = model(x, position_ids=torch.arange(e)).logits  # default mask: block-causal
        out[:, s:e] = logits[:, s:e]
    return out


def batch(seed=1, B=3, L=14):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(8, 100, (B, L), generator=g)
    response = torch.zeros(B, L, dtype=torch.bool)
    response[:, 3:] = True
    nb = make_noisy(clean, response, mask_id=2, t_min=0.2, t_max=0.9, t2t_rate=0.3,
                    allowed_ids=substitution_ids(128, range(8)), generator=g)
    return clean, response, nb


def test_vectorized_equals_per_block_loop():
    model = small_model()
    clean, response, nb = batch()  # L=14: the last block is partial
    with torch.no_grad():
        vec = model.lm_head(noisy_half_hidden(model, nb.noisy, clean, K)).float()
        ref = per_block_logits(model, nb.noisy, clean)
    assert torch.allclose(vec, ref, atol=1e-4)


def test_mixture_loss_terms_match_plain_cross_entropy():
    model = small_model()
    clean, response, nb = batch(seed=5)
    cfg = ObjectiveConfig(t2t_weight=0.7, keep_weight=0.3, mtf_weight=0.0)
    with torch.no_grad():
        loss, m, _ = mixture_loss(model, model.lm_head, clean, response, nb, cfg, K, mask_id=2)
        ref = per_block_logits(model, nb.noisy, clean)

    def ce(sel):
        return F.cross_entropy(ref[sel], clean[sel]).item()

    expected = ce(nb.masked) + 0.7 * (ce(nb.substituted) + 0.3 * ce(nb.kept))
    assert abs(m["loss/m2t"] - ce(nb.masked)) < 1e-4
    assert abs(loss.item() - expected) < 1e-4

    elbo = ObjectiveConfig(t2t_weight=0.0, mtf_weight=0.0, normalize="elbo")
    with torch.no_grad():
        loss_e, _, _ = mixture_loss(model, model.lm_head, clean, response, nb, elbo, K, mask_id=2)
    tok = F.cross_entropy(ref.reshape(-1, ref.shape[-1]), clean.reshape(-1), reduction="none").view_as(clean)
    manual = sum(tok[i][nb.masked[i]].sum().item() / nb.t[i].item() for i in range(clean.shape[0])) / response.sum().item()
    assert abs(loss_e.item() - manual) < 1e-4


def test_mtf_second_pass_uses_own_predictions():
    model = small_model(seed=3)
    clean, response, nb = batch(seed=7)
    cfg = ObjectiveConfig(t2t_weight=0.0, mtf_weight=1.0, mtf_fraction=1.0)
    with torch.no_grad():
        loss, m, draft = mixture_loss(model, model.lm_head, clean, response, nb, cfg, K, mask_id=2)
        ref1 = per_block_logits(model, nb.noisy, clean)
        ref1[..., 2] = float("-inf")
        own = ref1.argmax(-1)
        expected_draft = torch.where(nb.masked, own, nb.noisy)
        assert torch.equal(draft, expected_draft)
        ref2 = per_block_logits(model, expected_draft, clean)
    mtf_ref = F.cross_entropy(ref2[nb.masked], clean[nb.masked]).item()
    assert abs(m["loss/mtf"] - mtf_ref) < 1e-4
    assert abs(loss.item() - (m["loss/m2t"] + mtf_ref)) < 1e-4


def test_loss_has_gradients_for_all_terms():
    model = small_model().train()
    clean, response, nb = batch(seed=9)
    loss, _, _ = mixture_loss(model, model.lm_head, clean, response, nb, ObjectiveConfig(), K, mask_id=2)
    loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
