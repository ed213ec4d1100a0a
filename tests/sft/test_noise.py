"""ebpo.core.noise: masking rates, prompt protection, T2T substitution rules (checked against plain counting)."""
import pytest
import torch

from ebpo.core.noise import m2t_mask, make_noisy, stratified_levels, substitution_ids, t2t_substitute


def test_stratified_levels_one_per_stratum():
    g = torch.Generator().manual_seed(0)
    t = stratified_levels(16, 0.2, 0.8, g)
    assert t.min() >= 0.2 and t.max() <= 0.8
    strata = sorted(int((x - 0.2) / (0.6 / 16)) for x in t.tolist())
    assert strata == list(range(16))


def test_m2t_rate_and_prompt_never_masked():
    g = torch.Generator().manual_seed(1)
    B, L = 400, 64
    response = torch.zeros(B, L, dtype=torch.bool)
    response[:, 20:] = True  # positions 0..19 are the prompt
    t = torch.full((B,), 0.3)
    masked = m2t_mask(response, t, g, min_one=False)
    assert not masked[:, :20].any()
    rate = masked[:, 20:].float().mean().item()
    n = B * 44
    assert abs(rate - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5  # 4 sigma of a binomial proportion


def test_m2t_per_example_levels_and_min_one():
    g = torch.Generator().manual_seed(2)
    response = torch.ones(2000, 8, dtype=torch.bool)
    t = torch.tensor([0.0, 0.9]).repeat(1000)
    masked = m2t_mask(response, t, g, min_one=True)
    assert (masked[0::2].sum(1) == 1).all()  # t=0 still gets exactly the one forced mask
    assert abs(masked[1::2].float().mean().item() - 0.9) < 0.02
    empty = torch.zeros(1, 8, dtype=torch.bool)
    assert not m2t_mask(empty, torch.tensor([0.5]), g).any()  # nothing to mask, nothing forced


def test_t2t_only_visible_never_original_uniform():
    g = torch.Generator().manual_seed(3)
    allowed = substitution_ids(16, [2, 3])  # 14 allowed ids
    tokens = torch.randint(0, 16, (3000, 20), generator=g)
    tokens[tokens == 2] = 2  # mask tokens present in the input
    candidates = torch.rand(3000, 20, generator=g) < 0.5
    new, sub = t2t_substitute(tokens, candidates, 0.25, allowed, g)
    assert not (sub & ~candidates).any()
    assert torch.equal(new[~sub], tokens[~sub])
    assert (new[sub] != tokens[sub]).all()
    assert torch.isin(new[sub], allowed).all()
    rate = sub[candidates].float().mean().item()
    assert abs(rate - 0.25) < 0.01
    # replacement of an allowed original is uniform over the 13 other allowed ids
    orig = tokens[sub]
    repl = new[sub]
    sel = repl[orig == 5]
    counts = torch.bincount(sel, minlength=16).float()
    assert counts[5] == 0 and counts[2] == 0 and counts[3] == 0
    others = counts[[i for i in allowed.tolist() if i != 5]]
    expected = sel.numel() / 13
    assert ((others - expected).abs() < 5 * expected ** 0.5).all()


def test_make_noisy_partitions_the_response():
    g = torch.Generator().manual_seed(4)
    clean = torch.randint(8, 100, (32, 24), generator=g)
    response = torch.zeros(32, 24, dtype=torch.bool)
    response[:, 6:] = True
    nb = make_noisy(clean, response, mask_id=2, t_min=0.1, t_max=0.9, t2t_rate=0.2,
                    allowed_ids=substitution_ids(100, [2]), generator=g)
    parts = nb.masked.int() + nb.substituted.int() + nb.kept.int()
    assert torch.equal(parts.bool(), response) and parts.max() == 1
    assert (nb.noisy[nb.masked] == 2).all()
    assert torch.equal(nb.noisy[nb.kept], clean[nb.kept])
    assert torch.equal(nb.noisy[~response], clean[~response])  # prompt untouched
    assert (nb.noisy[nb.substituted] != clean[nb.substituted]).all()


def test_bad_arguments_raise():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError):
        stratified_levels(4, 0.8, 0.2, g)
    with pytest.raises(ValueError):
        t2t_substitute(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), 0.5,
                       torch.tensor([3]), g)
