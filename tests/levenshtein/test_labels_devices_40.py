"""The Levenshtein label functions (`ebpo.core.levenshtein`) keep every tensor they make on their inputs' device:
under a `meta` default device, with the inputs on the CPU, they return exactly what they return without one (a
table, index or buffer made on the default device would be `meta` and fail where it meets the CPU inputs). This
is the rule a second device shows, checked on a CPU-only machine (issue 40's device survivors of levenshtein.py,
once judged "CPU-only equivalent")."""
import torch

from ebpo.core.levenshtein import alignment, apply_labels, apply_ops, lcs_labels, rounds_to_target

MASK = 9


def _blocks(seed: int, N: int = 40, K: int = 6):
    """Random short blocks over a 4-letter alphabet plus the mask, so matches, shifts and masks are common."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, 4, (N, K), generator=g)
    draft[torch.rand(N, K, generator=g) < 0.2] = MASK
    target = torch.randint(0, 4, (N, K), generator=g)
    return draft, target


def _all(draft, target):
    ops, toks = lcs_labels(draft, target, MASK)
    return (alignment(draft, target, MASK), ops, toks, apply_ops(draft, ops, toks, MASK),
            apply_labels(draft, target, MASK), rounds_to_target(draft, target, MASK, max_rounds=3))


def test_label_functions_give_the_same_under_a_meta_default_device():
    for seed in range(3):
        draft, target = _blocks(seed)
        want = _all(draft, target)
        with torch.device("meta"):
            got = _all(draft, target)
        for w, x in zip(want, got):
            assert x.device.type == "cpu" and x.dtype == w.dtype and torch.equal(x, w)
        assert (want[1] != 0).any() and (want[5] > 0).any()  # edits and multi-round blocks happen
