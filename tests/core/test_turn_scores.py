"""`score_turns`: the public per-turn scoring recipe. Checked against a plain loop (each turn's blocks scored
one forward each over [clean prefix ; noisy block], float64) on real multi-turn trajectories of the shipped
tiny model, with the noise the function drew; rows batched with padding score as they do alone."""
import pytest
import torch

from ebpo.core.turn_scores import score_turns
from ebpo.infra.data import encode_prompt
from ebpo.model.loading import load_model, load_model_tokenizer
from rollout.config import DecodeConfig
from rollout.multiturn import MultiTurnConfig, generate_multiturn


class Scripted:
    """Answers each turn with a short observation; done after `n` turns."""

    def __init__(self, n):
        self.n, self.k = n, 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        return f"obs{self.k}", 0.0, self.k >= self.n, {}


@pytest.fixture(scope="module")
def trajectories():
    model, tok = load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")
    prompts = [encode_prompt(tok, q) for q in ("Compute 12+7.", "Compute 45-3.")]
    trajs = generate_multiturn(model, prompts, [Scripted(3), Scripted(2)], DecodeConfig.preset("quality", mbe_window=0),
                               MultiTurnConfig(max_turn_tokens=16, stop_at_tool_call=False), tokenizer=tok)
    assert [len(t.turns) for t in trajs] == [3, 2] and len(trajs[0].ids) != len(trajs[1].ids)
    return model, trajs


def reference_turn(model, ids, masked, weight, t_end, K, mask_id):
    """One turn by hand: the sequence cut at the turn's end, each of its blocks with a masked token scored by
    its own forward over [clean tokens before the block ; the block with its masked tokens replaced]."""
    total = torch.zeros((), dtype=torch.float64)
    x = torch.tensor(ids[:t_end])
    for b0 in range(0, t_end, K):
        m = masked[b0:b0 + K]
        if not m.any():
            continue
        block = x[b0:b0 + K].clone()
        block[m] = mask_id
        logp = model(torch.cat([x[:b0], block])[None]).logits[0, b0:].double().log_softmax(-1)
        for j in m.nonzero().flatten().tolist():
            total += logp[j, x[b0 + j]] * float(weight[b0 + j])
    return total


def test_score_turns_matches_a_per_turn_per_block_loop(trajectories):
    model, trajs = trajectories
    K, mask_id = model.config.block_size, model.config.mask_token_id
    s = score_turns(model, trajs, n_draws=2, seed=3)
    assert s.per_turn.shape == (2, 2, 3) and s.n_turns.tolist() == [3, 2]
    assert torch.allclose(s.per_turn.sum(-1), s.composite, atol=1e-4)
    assert (s.per_turn[1, :, 2] == 0).all()  # row 1 has two turns
    with torch.no_grad():
        for i, tr in enumerate(trajs):
            for t, turn in enumerate(tr.turns):
                own = torch.zeros(s.noise.masked.shape[-1], dtype=torch.bool)
                own[turn.start:turn.end] = True  # only this turn's tokens are scored
                for n in range(2):
                    ref = reference_turn(model, tr.ids, s.noise.masked[n, i] & own, s.noise.weight[n, i], turn.end,
                                         K, mask_id)
                    # fp32 against float64: ~30 terms of size up to ~100 (log-prob ~10 x weight 1/t_min), each a few fp32
                    # ulps (1.2e-7 relative) off: far under 1e-3
                    assert torch.allclose(s.per_turn[i, n, t].double(), ref, rtol=1e-4, atol=1e-3), (i, t, n)
    assert s.mean().shape == (2, 3)


def test_a_row_scores_the_same_alone_and_padded_in_a_batch(trajectories):
    model, trajs = trajectories
    g = torch.Generator().manual_seed(5)
    both = score_turns(model, trajs, n_draws=2, generator=g)
    # the same masks, cut to the short row's own length, must give the short row's scores alone
    i = min(range(2), key=lambda j: len(trajs[j].ids))
    L = len(trajs[i].ids)
    from ebpo.core.likelihood import NoiseDraws

    alone_noise = NoiseDraws(masked=both.noise.masked[:, i:i + 1, :L], t=both.noise.t[:, i:i + 1, :L // 8],
                             weight=both.noise.weight[:, i:i + 1, :L], block_size=8)
    from ebpo.core.likelihood import all_composites

    with torch.no_grad():
        comp = all_composites(model, torch.tensor([trajs[i].ids]), alone_noise, model.config.mask_token_id)
    assert torch.allclose(comp[0], both.composite[i], atol=1e-4)


def test_dicts_work_and_bad_rows_are_refused(trajectories):
    model, trajs = trajectories
    a = score_turns(model, trajs, n_draws=1, seed=0)
    b = score_turns(model, [t.to_dict() for t in trajs], n_draws=1, seed=0)
    assert torch.equal(a.per_turn, b.per_turn)
    bad = trajs[0].to_dict()
    bad["generated"] = bad["generated"][:-1]
    with pytest.raises(ValueError, match="differ in length"):
        score_turns(model, [bad])
    with pytest.raises(ValueError, match="no trajectories"):
        score_turns(model, [])
