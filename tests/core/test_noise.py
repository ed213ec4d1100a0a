"""ebpo.core.noise: masking rates, prompt protection, T2T substitution rules (checked against plain counting).

Also: randomness only from the generator passed in, min_one by default (one forced mask, always inside the
response, never in a row without response), no T2T at rate 0 (allowed_ids not needed), the bounds of t_min / t_max
and of the allowed ids, with their messages, and the id ranges of substitution_ids."""
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


def _resp(B=6, L=10):
    resp = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B - 1):
        resp[i, 2 + i % 3: L - i % 2] = True
    return resp  # the last row has no response


def test_every_draw_comes_from_the_generator_only():
    resp, clean = _resp(), torch.randint(8, 60, (6, 10), generator=torch.Generator().manual_seed(0))
    allowed = substitution_ids(64, [0, 2])
    outs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
        nb = make_noisy(clean, resp, mask_id=2, t_min=0.0, t_max=0.3, t2t_rate=0.5, allowed_ids=allowed, generator=g())
        outs.append([stratified_levels(8, 0.1, 0.9, g()), m2t_mask(resp, torch.zeros(6), g()),
                     *t2t_substitute(clean, resp, 0.5, allowed, g()), nb.noisy, nb.masked, nb.substituted, nb.t])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_min_one_is_the_default_and_forces_one_response_position():
    resp = _resp()
    for seed in range(20):
        m = m2t_mask(resp, torch.zeros(6), torch.Generator().manual_seed(seed))  # t = 0: nothing drawn
        assert m[:5].sum(1).tolist() == [1] * 5 and not m[5].any() and not (m & ~resp).any(), seed
        assert not m2t_mask(resp, torch.zeros(6), torch.Generator().manual_seed(seed), min_one=False).any()
        nb = make_noisy(torch.full((6, 10), 9), resp, mask_id=2, t_min=0.0, t_max=0.0, t2t_rate=0.0, allowed_ids=None,
                        generator=torch.Generator().manual_seed(seed))
        assert nb.masked[:5].sum(1).tolist() == [1] * 5 and not nb.masked[5].any()
        # rate 0: no substitution, no allowed ids needed, every other response position kept
        assert nb.substituted.dtype == torch.bool and not nb.substituted.any()
        assert torch.equal(nb.kept, resp & ~nb.masked) and torch.equal(nb.noisy, torch.full((6, 10), 9).masked_fill(
            nb.masked, 2))
    with pytest.raises(ValueError, match=r"^t2t_rate > 0 needs allowed_ids$"):
        make_noisy(torch.full((6, 10), 9), resp, mask_id=2, t_min=0.1, t_max=0.2, t2t_rate=0.1, allowed_ids=None,
                   generator=torch.Generator().manual_seed(0))


def test_level_bounds():
    g = torch.Generator().manual_seed(0)
    for lo, hi in [(0.0, 0.0), (0.0, 1.0), (0.4, 0.4), (1.0, 1.0)]:
        t = stratified_levels(16, lo, hi, g)
        assert ((t >= lo) & (t <= hi)).all()
    for lo, hi in [(-0.1, 0.5), (0.6, 0.5), (0.2, 1.5), (1.2, 1.5)]:
        with pytest.raises(ValueError, match=rf"^noise levels need 0 <= t_min <= t_max <= 1, got t_min={lo}, "
                                             rf"t_max={hi}$"):
            stratified_levels(4, lo, hi, g)


def test_allowed_ids_bounds_and_tokens_outside_them():
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([[3, 4, 99, 0, 5, 50]])
    for allowed in (torch.tensor([3, 4]), torch.tensor([1, 3, 4, 7])):  # two ids are enough
        new, sub = t2t_substitute(tokens, torch.ones_like(tokens, dtype=torch.bool), 1.0, allowed, g)
        assert sub.all() and set(new.flatten().tolist()) <= set(allowed.tolist()) and not (new == tokens).any()
    for allowed in (torch.tensor([3]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match=r"^t2t substitution needs at least two allowed token ids$"):
            t2t_substitute(tokens, torch.ones_like(tokens, dtype=torch.bool), 0.5, allowed, g)


def test_substitution_ids_excludes_only_ids_inside_the_vocabulary():
    assert substitution_ids(6, [0, 5]).tolist() == [1, 2, 3, 4]
    assert substitution_ids(6, [-1, 6, 7, 2]).tolist() == [0, 1, 3, 4, 5]
    ids = substitution_ids(6, [])
    assert ids.tolist() == list(range(6)) and ids.dtype == torch.long


def test_make_noisy_passes_min_one_and_t2t_rate_bounds_and_absent_tokens_draw_every_id():
    resp = _resp()
    nb = make_noisy(torch.full((6, 10), 9), resp, mask_id=2, t_min=0.0, t_max=0.0, t2t_rate=0.0, allowed_ids=None,
                    generator=torch.Generator().manual_seed(0), min_one=False)
    assert not nb.masked.any()  # t = 0 and no forcing: nothing masked
    g = torch.Generator().manual_seed(0)
    tokens = torch.full((1, 400), 50)  # not among the allowed ids: uniform over all of them
    for rate in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"^t2t rate must lie in \[0, 1\], got {rate}$"):
            t2t_substitute(tokens, torch.ones_like(tokens, dtype=torch.bool), rate, torch.tensor([3, 4, 7]), g)
    new, _ = t2t_substitute(tokens, torch.ones_like(tokens, dtype=torch.bool), 1.0, torch.tensor([3, 4, 7]), g)
    # 400 uniform draws over 3 ids: an id is missed with probability (2/3)^400 < 1e-70
    assert set(new.flatten().tolist()) == {3, 4, 7}


def test_t2t_substitute_draws_on_the_generator_s_device_whatever_the_default_device():
    """Both uniforms (which positions, which replacement) are drawn on the generator's device: under a `meta`
    default device, with tokens and generator on the CPU, the substitution is the same (a draw on the default
    device would be `meta` and fail where it meets the CPU tensors)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (3, 12), generator=g)
    candidates = torch.rand(3, 12, generator=g) < 0.8
    allowed = substitution_ids(40, [0, 1])
    want = t2t_substitute(tokens, candidates, 0.5, allowed, torch.Generator().manual_seed(5))
    with torch.device("meta"):
        got = t2t_substitute(tokens, candidates, 0.5, allowed, torch.Generator().manual_seed(5))
    assert got[0].device.type == "cpu" and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int(want[1].sum()) < int(candidates.sum())
