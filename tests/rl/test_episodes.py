"""Learner rows of agent episodes (`ebpo.rl.episodes`): every segment of a forked episode is a row, with the
episode's advantage scaled per `env.episode_norm`, checked against a plain reading of the rule; the rows go
through `build_learner_batch` with each segment's own ids and turn mask."""
import pytest
import torch

from ebpo.rl.episodes import episode_rows, episode_scale
from ebpo.rl.records import RolloutSample, build_learner_batch

K = 4


def _segment(prompt, turns, start_token):
    """A laid-out trajectory dict: `prompt` context tokens, then `turns` model turns of one block each, each
    followed (but the last) by a 2-token observation (the next turn shares the observation's block)."""
    ids, gen, seg = list(range(100, 100 + prompt)), [False] * prompt, [0] * prompt
    tok = start_token
    for t in range(turns):
        pad = -len(ids) % K
        ids += [1] * pad
        gen += [False] * pad
        seg += [seg[-1]] * pad
        ids += list(range(tok, tok + K))
        gen += [True] * K
        seg += [2 * t + 1] * K
        tok += K
        if t + 1 < turns:
            ids += [7, 8]
            gen += [False, False]
            seg += [2 * t + 2] * 2
    return {"prompt_ids": ids[:prompt], "ids": ids, "generated": gen, "segment": seg,
            "turns": [{"index": t} for t in range(turns)], "lev_drafts": []}


def _sample(traj, segments=()):
    t = dict(traj, segments=[dict(s, stop="rewritten") for s in segments])
    return RolloutSample(token_ids=t["ids"][len(t["prompt_ids"]):], text="", num_forwards=1, tpf=1.0, num_edits=0,
                         finished_by_eos=True, trajectory=t)


def _episodes():
    plain = _sample(_segment(5, 2, 10))  # two turns, no fork
    forked = _sample(_segment(6, 1, 30), [_segment(5, 2, 50), _segment(3, 1, 70)])  # 3 segments, 4 turns in all
    return [plain, forked], torch.tensor([0.8, -0.6]), torch.tensor([0, 0])


@pytest.mark.parametrize("norm", ["none", "segments", "turns"])
def test_every_segment_is_a_row_with_the_scaled_episode_advantage(norm):
    samples, adv, gid = _episodes()
    rows = episode_rows([s.prompt_ids for s in samples], samples, adv, gid, norm)
    # plain reading: episode -> (number of segments, turns over all segments)
    expected = []
    for s, a in zip(samples, adv.tolist()):
        segs = [s.trajectory] + s.trajectory["segments"]
        k, turns = len(segs), sum(len(x["turns"]) for x in segs)
        w = {"none": 1.0, "segments": 1.0 / k, "turns": 1.0 / turns}[norm]
        expected += [(x["ids"], a * w) for x in segs]
    assert [(p + t, a) for p, t, a in zip(rows.prompt_ids, rows.token_ids, rows.advantages)] == \
        [(ids, pytest.approx(a, rel=1e-6)) for ids, a in expected]
    assert len(rows.turns) == 4 and all(r is not None for r in rows.turns)
    total = {"none": [1.6, -1.8], "segments": [0.8, -0.6], "turns": [0.8, -0.6]}[norm]
    per_episode = [sum(rows.advantages[:1]), sum(rows.advantages[1:])]
    if norm == "segments":  # each episode's rows add up to its advantage
        assert per_episode == pytest.approx(total)
    assert episode_scale(None, norm) == 1.0


def test_segment_rows_reach_the_learner_with_their_own_ids_and_mask():
    samples, adv, gid = _episodes()
    rows = episode_rows([s.prompt_ids for s in samples], samples, adv, gid, "segments")
    batch = build_learner_batch(rows.prompt_ids, rows.token_ids, torch.tensor(rows.advantages),
                                torch.tensor(rows.group_ids), pad_id=0, tail_ids=rows.tail_ids,
                                weight_version=rows.weight_version, lev_drafts=rows.lev_drafts, turns=rows.turns,
                                block_size=K)
    segs = [samples[0].trajectory, samples[1].trajectory, *samples[1].trajectory["segments"]]
    for i, seg in enumerate(segs):
        L = len(seg["ids"])
        assert batch.input_ids[i, :L].tolist() == seg["ids"]
        assert batch.response_mask[i, :L].tolist() == seg["generated"]
        assert not batch.response_mask[i, L:].any()
    assert batch.advantages.tolist() == pytest.approx([0.8, -0.2, -0.2, -0.2])


def test_a_bad_norm_is_refused_naming_the_allowed_values():
    samples, adv, gid = _episodes()
    with pytest.raises(ValueError, match="segments"):
        episode_rows([s.prompt_ids for s in samples], samples, adv, gid, "episode")
