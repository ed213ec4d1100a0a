"""Rules of ebpo/core/likelihood.py that the composite tests leave open, each against a plain reading.

* `response_mask_from_ids`: response = prompt end up to and including the first EOS at or after the prompt, cut at
  `seq_lens` when given; bad shapes refused with messages naming the argument;
* `NoiseDraws`: `scored()` is masked | substituted; `rows` / `take` are the plain slices of every field (t cut to
  whole blocks; a length >= L is everything); `take` refuses a length that is not a whole number of blocks;
* `draw_noise`: its bounds refused with messages naming them; `turn_response_mask`: its message says the fix;
* `per_turn_composites`: any per-block values split by the turn each block holds, context blocks to no turn;
* `direct_backward` / `replay_backward`: (loss, metrics, C) or, with return_blocks, (C, blocks); replaying in
  chunks of draws gives the direct gradient.
"""
import copy
import random

import pytest
import torch

from ebpo.core.likelihood import (NoiseDraws, all_composites, direct_backward, draw_noise, per_turn_composites,
                                  replay_backward, response_mask_from_ids, turn_response_mask)

EOS = 1


def _plain_response_mask(ids, prompt_lens, seq_lens):
    B, L = ids.shape
    out = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        end = L if seq_lens is None else int(seq_lens[i])
        for p in range(int(prompt_lens[i]), end):
            out[i, p] = True
            if int(ids[i, p]) == EOS:
                break
    return out


@pytest.mark.parametrize("seed", range(6))
def test_response_mask_with_and_without_seq_lens_is_the_plain_loop(seed):
    rng = random.Random(seed)
    B, L = 5, rng.randint(1, 12)
    ids = torch.tensor([[rng.choice([EOS, 3, 4, 5]) for _ in range(L)] for _ in range(B)])  # EOS anywhere
    prompt_lens = torch.tensor([rng.randint(0, L) for _ in range(B)], dtype=torch.int32)  # not long: converted
    seq_lens = torch.tensor([rng.randint(int(p), L) for p in prompt_lens], dtype=torch.int32)
    for sl in (None, seq_lens):
        got = response_mask_from_ids(ids, prompt_lens, EOS, seq_lens=sl)
        assert got.dtype == torch.bool and torch.equal(got, _plain_response_mask(ids, prompt_lens, sl)), (sl, got)


def test_response_mask_refuses_bad_shapes_naming_the_argument():
    with pytest.raises(ValueError, match=r"input_ids: expected \(B, L\), got \(4,\)"):
        response_mask_from_ids(torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.long), EOS)
    with pytest.raises(ValueError, match=r"prompt_lens: expected shape \(2,\), got \(3,\)"):
        response_mask_from_ids(torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long), EOS)


def _draws(N=3, B=4, L=12, K=4, sub=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    masked = torch.rand(N, B, L, generator=g) < 0.3
    substituted = (torch.rand(N, B, L, generator=g) < 0.3) & ~masked if sub else None
    return NoiseDraws(masked=masked, t=torch.rand(N, B, (L + K - 1) // K, generator=g),
                      weight=torch.rand(N, B, L, generator=g), block_size=K, substituted=substituted,
                      sub_ids=torch.randint(0, 50, (N, B, L), generator=g) if sub else None,
                      noisy_ids=torch.randint(0, 50, (N, B, L), generator=g),
                      targets=torch.randint(0, 50, (N, B, L), generator=g))


def test_scored_is_masked_or_substituted():
    nz = _draws()
    assert torch.equal(nz.scored(), nz.masked | nz.substituted)
    only = _draws(sub=False)
    assert torch.equal(only.scored(), only.masked)


FIELDS = ("masked", "weight", "substituted", "sub_ids", "noisy_ids", "targets")


@pytest.mark.parametrize("sub", [True, False])
def test_rows_and_take_are_plain_slices_of_every_field(sub):
    N, B, L, K = 3, 4, 12, 4
    nz = _draws(N, B, L, K, sub=sub)
    idx = torch.tensor([2, 0])
    for length, got in ((None, nz.rows(idx)), (None, nz.take(idx)), (L, nz.take(idx, L)),
                        (None, nz.take(idx, L + K)), (8, nz.take(idx, 8)), (4, nz.take(idx, 4))):
        cut = L if length is None else length
        assert got.block_size == K and got.n_draws == N
        assert torch.equal(got.t, nz.t[:, [2, 0], : cut // K])
        for f in FIELDS:
            want = getattr(nz, f)
            if want is None:
                assert getattr(got, f) is None, f
            else:
                assert torch.equal(getattr(got, f), want[:, [2, 0], :cut]), (f, length)


def test_take_refuses_a_length_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="NoiseDraws.take: length 6 is not a multiple of the block size 4"):
        _draws().take(torch.tensor([0]), 6)


@pytest.mark.parametrize("t_min,t_max", [(0.0, 0.5), (-0.1, 0.5), (0.6, 0.5), (0.2, 1.01)])
def test_draw_noise_refuses_levels_outside_0_1(t_min, t_max):
    with pytest.raises(ValueError, match=rf"t_min/t_max: need 0 < t_min <= t_max <= 1, got t_min={t_min}, "
                                         rf"t_max={t_max}"):
        draw_noise(torch.ones(1, 4, dtype=torch.bool), 4, 2, t_min, t_max, torch.Generator().manual_seed(0))


def test_draw_noise_accepts_the_closed_bounds_and_refuses_zero_draws():
    nz = draw_noise(torch.ones(1, 4, dtype=torch.bool), 4, 1, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert nz.masked.all() and torch.equal(nz.t, torch.ones(1, 1, 1))  # t = 1 masks every response token
    with pytest.raises(ValueError, match="n_draws: must be >= 1, got 0"):
        draw_noise(torch.ones(1, 4, dtype=torch.bool), 4, 0, 0.2, 0.5, torch.Generator().manual_seed(0))


def test_turn_response_mask_says_how_to_fix_a_leaking_block():
    generated = torch.tensor([[False, True, True, False]])  # a model turn, then environment tokens in its block
    segment = torch.tensor([[0, 1, 1, 2]])
    with pytest.raises(ValueError, match=r"row 0 block 0 holds model tokens and a later segment \(environment "
                                         r"tokens after a turn must start a new block: "
                                         r"ebpo\.core\.turns\.layout_segments\)"):
        turn_response_mask(generated, segment, 4)


def _plain_per_turn(blocks, turn, K, n_turns):
    B, N, nb = blocks.shape
    out = torch.zeros(B, N, n_turns, dtype=blocks.dtype)
    for i in range(B):
        for b in range(nb):
            owners = {int(x) for x in turn[i, b * K:(b + 1) * K] if int(x) >= 0}
            assert len(owners) <= 1  # aligned turns: a block belongs to at most one turn
            for t in owners:
                out[i, :, t] += blocks[i, :, b]
    return out


@pytest.mark.parametrize("L", [8, 9, 10, 11, 13])
def test_per_turn_composites_give_each_turn_its_blocks_and_context_blocks_nothing(L):
    """Any per-block values (not only composites, which are 0 where nothing is generated): a block's value goes
    to the turn whose tokens it holds; blocks of context only (a partial last one included) count for no turn;
    turns beyond the ones present get 0 (shape (B, N, n_turns))."""
    K, n_turns, B, N = 4, 4, 3, 2
    nb = -(-L // K)
    rng = random.Random(L)
    turn = torch.full((B, L), -1)
    for i in range(B):  # whole blocks of one turn each, in order; context elsewhere (and the last block's tail)
        t = -1
        for b in range(nb):
            if rng.random() < 0.5 and b < nb - (L % K != 0) and t < 1:  # turns 0, 1 only: 2, 3 stay empty
                t += 1
                lo = b * K + rng.randint(0, K - 1)
                turn[i, lo:(b + 1) * K] = t
    blocks = torch.randn(B, N, nb, generator=torch.Generator().manual_seed(L), dtype=torch.float64)
    got = per_turn_composites(blocks, turn, K, n_turns)
    assert got.shape == (B, N, n_turns) and got.dtype == blocks.dtype
    # float64 sums of at most nb = 4 unit-sized terms, in any order: 1e-12 is far above their rounding
    assert torch.allclose(got, _plain_per_turn(blocks, turn, K, n_turns), rtol=0, atol=1e-12)


def _loss_fn(c):
    return (c * torch.linspace(-1.0, 1.0, c.numel()).view_as(c)).sum(), {"n": c.numel()}


@pytest.mark.parametrize("path", ["direct", "replay"])
def test_backward_paths_return_the_composites_and_with_return_blocks_their_blocks(small_model, path):
    """(loss, metrics, C) with C (B, N) detached, the no-grad composites; with return_blocks the last item is
    (C, per-block composites (B, N, nb)) whose sum over blocks is C. fp32 sums of < 50 terms of a few units:
    1e-4 is far above their rounding."""
    K, N = 4, 3
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    resp = torch.zeros(2, 10, dtype=torch.bool)
    resp[0, 3:], resp[1, 6:] = True, True
    nz = draw_noise(resp, K, N, 0.2, 0.9, torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_blocks = all_composites(small_model, ids, nz, 2, return_blocks=True)
    run = direct_backward if path == "direct" else replay_backward
    loss, metrics, comp = run(small_model, ids, nz, 2, _loss_fn)
    assert isinstance(comp, torch.Tensor) and comp.shape == (2, N) and not comp.requires_grad
    assert torch.allclose(comp, want, atol=1e-4) and metrics == {"n": 2 * N}
    assert torch.allclose(loss, _loss_fn(want)[0], atol=1e-4) and not loss.requires_grad
    loss, _, (comp, blocks) = run(small_model, ids, nz, 2, _loss_fn, return_blocks=True)
    assert blocks.shape == (2, N, 3) and not comp.requires_grad and not blocks.requires_grad
    assert torch.allclose(comp, want, atol=1e-4) and torch.allclose(blocks, want_blocks, atol=1e-4)
    small_model.zero_grad(set_to_none=True)


def test_take_of_the_whole_length_is_rows_even_with_a_partial_last_block():
    """length >= L means all positions (the docstring's "None = all"), also when L is not whole blocks."""
    nz = _draws(N=2, B=3, L=10, K=4)
    idx = torch.tensor([1, 2])
    for length in (10, 11, 12):
        got = nz.take(idx, length)
        assert torch.equal(got.t, nz.t[:, [1, 2]]) and got.t.shape[-1] == 3
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(nz, f)[:, [1, 2]]), (f, length)


@pytest.mark.parametrize("replay_chunk,nograd_chunk", [(2, 3), (3, 0), (4, 1)])
def test_replay_in_chunks_of_draws_gives_the_direct_gradient(small_model, replay_chunk, nograd_chunk):
    """Replaying `replay_chunk` draws at a time (the last chunk shorter when it does not divide N) adds each draw's
    gradient once: the same parameter gradient as one direct backward. fp32 gradients of a 2-layer model summed
    over N = 5 draws of a few units each: rtol 1e-3 / atol 1e-6 is far above their rounding, far below a draw
    counted twice or left out."""
    K, N = 4, 5
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    resp = torch.zeros(2, 10, dtype=torch.bool)
    resp[0, 2:], resp[1, 5:] = True, True
    nz = draw_noise(resp, K, N, 0.2, 0.9, torch.Generator().manual_seed(3))
    m1, m2 = copy.deepcopy(small_model), copy.deepcopy(small_model)
    direct_backward(m1, ids, nz, 2, _loss_fn)
    replay_backward(m2, ids, nz, 2, _loss_fn, replay_chunk=replay_chunk, nograd_chunk=nograd_chunk)
    n = 0
    for (name, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        if p1.grad is not None and p1.grad.abs().max() > 0:
            n += 1
            assert torch.allclose(p1.grad, p2.grad, rtol=1e-3, atol=1e-6), name
    assert n > 10


class _Head(torch.nn.Module):
    def __init__(self, H=16, V=40, bias=False, dtype=torch.float32):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.head = torch.nn.Linear(H, V, bias=bias).to(dtype)
            if bias:
                torch.nn.init.normal_(self.head.bias, std=3.0)  # large enough that leaving it out shows

    def get_output_embeddings(self):
        return self.head


def _plain_logprobs(model, hidden, targets):
    """float64 log-softmax of the head's (fp32-valued) weight and bias at the targets."""
    head = model.get_output_embeddings()
    z = hidden.double() @ head.weight.double().t()
    if head.bias is not None:
        z = z + head.bias.double()
    return z.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("bias,dtype,kernel", [(True, torch.float32, True), (False, torch.bfloat16, True),
                                               (False, torch.float32, False), (True, torch.bfloat16, False)])
def test_gathered_logprobs_is_the_fp32_log_softmax_of_the_head(monkeypatch, bias, dtype, kernel):
    """With or without a bias, with bf16 or fp32 head weights, with or without the fused kernel: fp32 log-probs of
    the head's own weights (bf16 ones read as fp32). fp32 logits are sums of H = 16 terms of size ~1 and the
    log-softmax sums V = 40: errors of a few 1e-6; 1e-4 is well above them and well below leaving out the bias
    (std 3) or rounding the hidden rows to bf16 (~1e-2)."""
    import ebpo.core.likelihood as lik

    if not kernel:
        monkeypatch.setattr(lik, "_kernel_token_logprobs", lambda: None)
    model = _Head(bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 16, generator=g)
    targets = torch.randint(0, 40, (23,), generator=g)
    got = lik.gathered_logprobs(model, hidden, targets)
    assert got.dtype == torch.float32 and got.shape == (23,)
    assert torch.allclose(got.double(), _plain_logprobs(model, hidden, targets), rtol=0, atol=1e-4)


def test_the_kernel_is_optional(monkeypatch):
    import sys

    import ebpo.core.likelihood as lik

    monkeypatch.setitem(sys.modules, "kernels.logprobs", None)  # the import fails
    assert lik._kernel_token_logprobs() is None


@pytest.mark.parametrize("dtype,grad", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_gathered_logprobs_through_the_head_module_runs_it_in_its_own_dtype(monkeypatch, dtype, grad):
    """use_module_head=True: the hidden rows are cast to the head's dtype, the module computes, and the log-probs
    come back fp32 with shape (M,), in one call or (with grad, M above the chunk) in chunks. bf16 logits of
    |z| ~ 3 carry errors ~ 2^-8 * 3 ~ 1e-2 after rounding the rows and weights: 0.1 bounds them (fp32: 1e-4)."""
    import ebpo.core.likelihood as lik

    monkeypatch.setattr(lik, "MODULE_HEAD_CHUNK", 7)
    model = _Head(dtype=dtype)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 16, generator=g, requires_grad=grad)
    targets = torch.randint(0, 40, (23,), generator=g)
    with torch.set_grad_enabled(grad):
        got = lik.gathered_logprobs(model, hidden, targets, use_module_head=True)
    assert got.dtype == torch.float32 and got.shape == (23,)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(got.detach().double(), _plain_logprobs(model, hidden.detach(), targets), rtol=0, atol=tol)


def test_draws_mask_and_force_independently_of_each_other():
    """Each draw has its own coins and its own forced-token choice. Two draws at t = 0.5 (t_min = t_max) with
    K = 16 response tokens: a token is masked in both with probability 1/4 (1/2 if the draws shared their coins;
    forcing, at 2^-16, is negligible). Two draws at t = 0.01 with m = 4 response tokens: a block is forced (nothing
    masked, probability 0.96) in both, and its one masked token is the same in both with probability 1/4 (1 if
    they shared the choice). Per row the fractions lie in [0, 1]; Hoeffding over 2000 rows (about 1840 in the
    second case) with eps = 0.1 bounds a false failure by 2 exp(-36) < 1e-15."""
    g = torch.Generator().manual_seed(7)
    nz = draw_noise(torch.ones(2000, 16, dtype=torch.bool), 16, 2, 0.5, 0.5, g)
    both = (nz.masked[0] & nz.masked[1]).float().mean(-1)
    assert abs(both.mean().item() - 0.25) < 0.1
    nz = draw_noise(torch.ones(2000, 4, dtype=torch.bool), 4, 2, 0.01, 0.01, g)
    single = nz.masked.sum(-1) == 1  # (2, B)
    rows = single[0] & single[1]
    same = (nz.masked[0] & nz.masked[1]).any(-1)[rows].float()
    assert rows.sum() > 1500 and abs(same.mean().item() - 0.25) < 0.1
