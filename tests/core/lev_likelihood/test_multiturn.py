"""Multi-turn L-EBPO: the learner scores agent trajectories whose turns carry pre-edit drafts (`lev_drafts`) with
the edit labels of single-turn L-EBPO, under the turn-aligned mask (ebpo/core/turns.py).

Pinned here, on a tiny random model with DELETE / INSERT ids and hand-built trajectories (prompt, three model turns,
two observations; drafts in every turn, one of them on a block that opens with the observation before it):
  * every per-turn composite equals a plain loop over turns and blocks, one forward per block over the sequence cut
    at the turn's end, labels read from the gap rules, only the model's tokens scored;
  * a turn's composite and per-block terms do not move when anything after it changes (tokens, observations,
    drafts, lengths), and they do move when the turn itself changes;
  * without drafts, multi-turn L-EBPO is multi-turn EBPO bit for bit (composites in every layout, a whole update);
  * a draft that rewrites the context opening its block is refused; the worker hands a trajectory's drafts on."""
import copy
import math

import pytest
import torch

from ebpo.core.lev_likelihood import drafts_from_rollouts, learner_draws
from ebpo.core.levenshtein import alignment
from ebpo.core.likelihood import all_composites, draw_noise, per_turn_composites
from ebpo.core.turns import layout_segments
from ebpo.model import LLaDA2MoeModelLM
from ebpo.model.presets import tiny_config
from ebpo.rl.learner import EBPOLearner, LearnerConfig
from ebpo.rl.records import build_learner_batch

K, EOS, MASK, DEL, INS = 4, 1, 2, 105, 106
LAM = 0.7  # learner.levenshtein_weight of the visible edit labels
EPS32 = torch.finfo(torch.float32).eps


# prompt 5, turn 6 (+2 filler), observation 2, turn 5 (+1 filler), observation 4, turn 3 (+1 filler): blocks of 4
# are [P P P P][P t t t][t t t f][o o t t][t t t f][o o o o][t t t f]; turn 1's first block opens with the
# observation before it, turn 0's with the prompt's tail
LENGTHS = [(5, False), (6, True), (2, False), (5, True), (4, False), (3, True)]


SEG_OF_TURN = [1, 3, 5]


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                          block_size=K, initializer_range=0.2))
    assert (m.config.delete_token_id, m.config.insert_token_id, m.config.mask_token_id) == (DEL, INS, MASK)
    return m.eval()


def segments(seed, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 100, (n,), generator=g).tolist(), gen) for n, gen in lengths]


def make_drafts(ids, gen, prompt_len, which):
    """Pre-edit drafts of the blocks `which` ({block index: kind}), as the decoder records them: offset of the block
    start from the prompt's end and the block's K tokens, its opening context unchanged. Kinds: "dup" (a generated
    token doubled: the decoder deleted the copy), "drop" (one missing, [MASK] at the tail: it inserted one),
    "swap" (one generated token different: a substitution)."""
    out = []
    for b, kind in sorted(which.items()):
        lo = b * K
        block, g = list(ids[lo:lo + K]), list(gen[lo:lo + K])
        if True not in g:  # a variant whose later layout put context here: the decoder wrote nothing there
            continue
        ctx = g.index(True)  # context prefix (prompt or observation tail)
        body = block[ctx:]
        if kind == "dup":
            body = [body[0]] + body[:-1]
        elif kind == "drop":
            body = body[1:] + [MASK]
        else:
            body = [97 if body[0] != 97 else 98] + body[1:]
        out.append((lo - prompt_len, block[:ctx] + body))
    return out


DRAFTS = {1: "dup", 3: "dup", 4: "drop", 6: "swap"}  # turn 0 (prompt tail first), turn 1 (two blocks), turn 2


def trajectory(segs, drafts=DRAFTS):
    """(prompt_ids, response_ids, (generated, segment), lev_drafts) of one laid-out trajectory."""
    lay = layout_segments(segs, K, EOS)
    P = len(segs[0][0])
    return lay.ids[:P], lay.ids[P:], (lay.generated, lay.segment), make_drafts(lay.ids, lay.generated, P, drafts)


def learner_rows(trajs):
    """The learner's batch of trajectories, built as `ebpo.rl.step.learn` builds it."""
    B = len(trajs)
    return build_learner_batch([t[0] for t in trajs], [t[1] for t in trajs], torch.zeros(B), torch.arange(B), EOS,
                               lev_drafts=[t[3] for t in trajs], turns=[t[2] for t in trajs], block_size=K)


def system_terms(model, batch, n_draws=3, seed=1, layout="packed", drafts=True):
    """Per-turn composites (B, N, 3), per-block terms (B, N, nb), the noise and the L-EBPO draws of the learner."""
    noise = draw_noise(batch.response_mask, K, n_draws, 0.1, 1.0, torch.Generator().manual_seed(seed))
    lev = learner_draws(noise, batch.input_ids, batch.response_mask, batch.prompt_lens,
                        batch.lev_drafts if drafts else None, model.config, LAM)
    with torch.no_grad():
        comp, blocks = all_composites(model, batch.input_ids, lev, MASK, packed=layout == "packed",
                                      cached=layout == "cached", return_blocks=True)
    per_turn = per_turn_composites(blocks, turn_of_token(batch), K, 3)
    return per_turn, blocks, noise, lev


def turn_of_token(batch):
    """(B, L) the model turn of each scored token: a new turn starts after every run of context tokens."""
    gen = batch.response_mask
    start = gen & torch.cat([torch.ones_like(gen[:, :1]), ~gen[:, :-1]], 1)
    idx = start.long().cumsum(1) - 1
    return torch.where(gen, idx, torch.full_like(idx, -1))


def plain_labels(x, y):
    """(label, keep) per draft position of one block, the gap rules read literally on the block's LCS anchors."""
    anchor = alignment(torch.tensor([x]), torch.tensor([y]), MASK)[0].tolist()
    out, pi, pj = [(DEL, False)] * len(x), -1, -1
    for i, j in [(i, j) for i, j in enumerate(anchor) if j >= 0]:
        free, tgt = list(range(pi + 1, i)), list(range(pj + 1, j))
        for r, p in enumerate(free):
            out[p] = (y[tgt[r]], False) if r < len(tgt) else (DEL, False)
        if len(tgt) > len(free):
            out[i] = (INS, False)
        else:
            out[i] = (y[j], x[i] != MASK)
        pi, pj = i, j
    return out


def reference(model, ids, gen, prompt_len, drafts, masked, t, n_turns=3):
    """Per-turn composites of one row and one draw, float64: for every turn, the sequence cut at the turn's end; for
    every block holding the turn's tokens, one forward over [clean tokens before it ; its noised draft]; scored:
    the turn's tokens that are masked (weight 1/t of the block) or carry a visible edit label (weight LAM).
    Returns (per-turn values, per-turn float tolerances) derived from the magnitudes summed."""
    L = len(ids)
    draft_at = {prompt_len + off: list(toks) for off, toks in drafts}
    turn, n, prev = [-1] * L, -1, False
    for p in range(L):
        if gen[p] and not prev:
            n += 1
        turn[p], prev = (n if gen[p] else -1), gen[p]
    vals, tols = [0.0] * n_turns, [0.0] * n_turns
    for tt in range(n_turns):
        pos = [p for p in range(L) if turn[p] == tt]
        end = max(pos) + 1
        x = ids[:end]
        for b0 in sorted({p - p % K for p in pos}):
            z = list(draft_at.get(b0, x[b0:b0 + K]))
            for j in range(K):
                if masked[b0 + j]:
                    z[j] = MASK
            labels = plain_labels(z, x[b0:b0 + K])
            score = [j for j in range(K) if turn[b0 + j] == tt and (masked[b0 + j] or not labels[j][1])]
            if not score:
                continue
            logits = model(torch.tensor([x[:b0] + z])).logits[0, b0:].double()
            logp = logits.log_softmax(-1)
            for j in score:
                w = 1.0 / float(t[b0 // K]) if masked[b0 + j] else LAM
                vals[tt] += w * float(logp[j, labels[j][0]])
                # fp32 forwards of different shapes round differently: a log-prob moves by a few hundred eps of
                # the logits' scale (two layers of width 64, a 128-way log-softmax)
                tols[tt] += w * 256 * EPS32 * (float(logits[j].abs().max()) + math.log(logits.shape[-1]))
    return vals, tols


@pytest.mark.parametrize("layout", ["packed", "unpacked", "cached"])
def test_per_turn_composites_equal_a_per_turn_per_block_reference_loop(model, layout):
    other = [(3, False), (9, True), (6, False), (2, True), (1, False), (7, True)]
    trajs = [trajectory(segments(0)), trajectory(segments(7, other), {0: "swap", 2: "drop", 4: "dup", 5: "drop", 6: "dup"})]
    batch = learner_rows(trajs)
    per_turn, _, noise, lev = system_terms(model, batch, n_draws=2, layout=layout)
    scored = lev.scored()
    assert not (scored & ~batch.response_mask[None]).any(), "only the model's tokens are scored"
    assert (lev.targets[scored] == DEL).any() and (lev.targets[scored] == INS).any()
    assert (lev.substituted & (lev.targets != DEL) & (lev.targets != INS)).any(), "a visible substitution label"
    with torch.no_grad():
        for i, tr in enumerate(trajs):
            ids = batch.input_ids[i].tolist()
            gen = batch.response_mask[i].tolist()
            for n in range(2):
                vals, tols = reference(model, ids, gen, len(tr[0]), tr[3], noise.masked[n, i].tolist(), noise.t[n, i])
                for tt in range(3):
                    assert abs(float(per_turn[i, n, tt]) - vals[tt]) <= tols[tt], (layout, i, n, tt)


def test_drafts_change_the_terms_of_their_blocks_only(model):
    """L-EBPO differs from EBPO exactly on the blocks that carry a draft (the draft is the noisy input there)."""
    batch = learner_rows([trajectory(segments(0))])
    _, with_d, _, _ = system_terms(model, batch)
    _, without, _, _ = system_terms(model, batch, drafts=False)
    differs = (with_d != without).any(1)[0].nonzero().flatten().tolist()
    assert differs == sorted(DRAFTS)


def test_a_turn_does_not_move_when_anything_later_changes(model):
    """The independent leakage check: everything after turn t (later turns' tokens and lengths, observations,
    drafts) is changed; turn t's composite and the terms of its blocks and of every block before stay put. A long
    second row fixes the batch shape, so the noise draws of row 0 are the same in every variant."""
    spacer = trajectory(segments(50, [(5, False), (30, True), (4, False), (10, True), (3, False), (6, True)]), {})
    base = segments(0)
    ref_turn, ref_blocks, _, _ = system_terms(model, learner_rows([trajectory(base), spacer]))
    for t, seg_idx in enumerate(SEG_OF_TURN[:2]):
        lay = layout_segments(base[: seg_idx + 1], K, EOS)
        nb_t = len(lay.ids) // K  # blocks up to turn t's end
        later_lengths = [(n + (1 if gen else 2), gen) for n, gen in LENGTHS[seg_idx + 1:]]
        variants = [base[: seg_idx + 1] + segments(100 + v)[seg_idx + 1:] for v in range(2)]  # tokens
        variants.append(base[: seg_idx + 1] + segments(200, LENGTHS[: seg_idx + 1] + later_lengths)[seg_idx + 1:])
        moved_future = False
        for segs in variants:
            for later in ({b: k for b, k in DRAFTS.items() if b < nb_t},  # later drafts dropped
                          {**DRAFTS, **{b: "drop" for b in DRAFTS if b >= nb_t}}):  # later drafts changed
                got_turn, got_blocks, _, _ = system_terms(model, learner_rows([trajectory(segs, later), spacer]))
                ref_b, got_b = ref_blocks[0, :, :nb_t], got_blocks[0, :, :nb_t]
                # the same operations on the same inputs up to turn t; only the expert GEMMs see other rows
                tol = 16 * EPS32 * float(ref_b.abs().sum()) + 1e-30
                assert (got_b - ref_b).abs().max() <= tol, (t, later)
                assert (got_turn[0, :, : t + 1] - ref_turn[0, :, : t + 1]).abs().max() <= tol, (t, later)
                moved_future |= not torch.allclose(got_turn[0, :, t + 1:], ref_turn[0, :, t + 1:])
        assert moved_future, "the check can see a change: the later turns' terms did move"
    # and turn 0's own tokens do move turn 0
    own = [base[0], segments(300)[1]] + base[2:]
    got_turn, _, _, _ = system_terms(model, learner_rows([trajectory(own), spacer]))
    assert not torch.allclose(got_turn[0, :, 0], ref_turn[0, :, 0])


@pytest.mark.parametrize("layout", ["packed", "unpacked", "cached"])
def test_without_drafts_multi_turn_l_ebpo_is_multi_turn_ebpo_bit_for_bit(model, layout):
    batch = learner_rows([trajectory(segments(0), {}), trajectory(segments(3), {})])
    noise = draw_noise(batch.response_mask, K, 3, 0.1, 1.0, torch.Generator().manual_seed(2))
    kw = dict(packed=layout == "packed", cached=layout == "cached", return_blocks=True)
    with torch.no_grad():
        a = all_composites(model, batch.input_ids, noise, MASK, **kw)
        for drafts in (None, [[], []]):
            lev = learner_draws(noise, batch.input_ids, batch.response_mask, batch.prompt_lens, drafts, model.config, 1.0)
            b = all_composites(model, batch.input_ids, lev, MASK, **kw)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_learner_update_on_trajectories_without_drafts_is_ebpo_and_with_drafts_differs(model):
    def rows(drafts):
        trajs = [trajectory(segments(s), drafts) for s in (0, 1, 2)]
        b = learner_rows(trajs)
        b.advantages = torch.tensor([1.0, -0.5, 0.3])
        return b

    cfg = dict(lr=1e-3, n_draws=2, mu=2, minibatch_size=2, seed=5)
    runs = {}
    for name, extra, batch in [("ebpo", {}, rows({})), ("lev_empty", {"levenshtein": True}, rows({})),
                               ("lev", {"levenshtein": True}, rows(DRAFTS))]:
        learner = EBPOLearner(copy.deepcopy(model), LearnerConfig(**cfg, **extra))
        m = learner.update(batch)
        runs[name] = ({k: v for k, v in m.items() if not k.startswith(("timing_s/", "likelihood/lev_"))},
                      {k: v.clone() for k, v in learner.model.state_dict().items()})
    (m0, w0), (m1, w1), (_, w2) = runs["ebpo"], runs["lev_empty"], runs["lev"]
    assert m0 == m1 and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert not all(torch.equal(w0[k], w2[k]) for k in w0)


def test_a_draft_that_rewrites_its_blocks_context_is_refused():
    prompt, response, (gen, _), drafts = trajectory(segments(0))
    batch = learner_rows([(prompt, response, (gen, _), drafts)])
    off, toks = drafts[1]  # block 3: two observation tokens, then turn 1
    bad = [[drafts[0], (off, [toks[0] + 1] + toks[1:]), *drafts[2:]]]
    with pytest.raises(ValueError, match="context"):
        drafts_from_rollouts(batch.input_ids, batch.prompt_lens, bad, K, batch.response_mask)
    ok = drafts_from_rollouts(batch.input_ids, batch.prompt_lens, [drafts], K, batch.response_mask)
    assert torch.equal(ok[0, 12:14], batch.input_ids[0, 12:14]) and not torch.equal(ok, batch.input_ids)


def test_the_rollout_worker_hands_a_trajectorys_drafts_to_the_learner_record(monkeypatch):
    """`RolloutWorker._generate_turns` copies `Trajectory.lev_drafts` into the sample, which the record keeps."""
    import rollout.multiturn
    from ebpo.rl.records import RolloutSample
    from rollout.trajectory import Trajectory
    from rollout.worker import RolloutWorker

    prompt, response, (gen, seg), drafts = trajectory(segments(0))
    traj = Trajectory(prompt_ids=prompt, ids=prompt + response, generated=gen, segment=seg, turns=[], stop="done")
    traj.lev_drafts = drafts
    monkeypatch.setattr(rollout.multiturn, "run_episodes", lambda *a, **k: [traj])
    worker = object.__new__(RolloutWorker)
    worker.env_factory, worker.multiturn, worker.model, worker.tokenizer, worker.version = object, {}, None, None, 3
    worker.engines = None  # the worker's engine holder, built on first use
    out = worker._generate_turns([prompt], [0], None, [{"prompt": "x"}])
    sample = RolloutSample.from_worker(out[0])
    assert sample.lev_drafts == [[off, list(t)] for off, t in drafts]
    traj.lev_drafts = []  # no DELETE / INSERT in this trajectory
    assert RolloutSample.from_worker(worker._generate_turns([prompt], [0], None, [{"prompt": "x"}])[0]).lev_drafts == []
