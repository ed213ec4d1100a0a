"""The compiled step's slots (`rollout.static_slots`, run eagerly: `rollout.compiled.COMPILE = False`) decode
what the eager loop decodes, bit for bit (its documented contract): tokens, traces, forwards, T2T edits,
DELETE / INSERT counts and L-EBPO drafts, with greedy and sampled decoding, on the stub model whose two layers
make any missing or stale key in the fixed-size cache change the tokens (issue 40's mutation target)."""
import pytest
import torch

import rollout.compiled as compiled
from rollout.config import DecodeConfig
from rollout.engine import Engine
from stub_model_mt40 import K, Rule, StubLM


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


PROMPTS = [[(3 * i + 5 * j) % 30 for j in range(n)] for i, n in enumerate([1, 9, 14, 4, 7, 22])]
CASES = [  # (decode options, rule, stub margin, lev)
    (dict(preset="quality"), Rule(eos=3), 10.0, False),
    (dict(preset="quality", stop_at_eos=False), Rule(eos=3, edit=True), 10.0, False),
    (dict(preset="m2t"), Rule(eos=5), 10.0, False),
    (dict(preset="quality", temperature=1.0), Rule(eos=4, edit=True), 4.0, False),
    (dict(preset="speed", temperature=0.7, top_k=5), Rule(eos=2), 3.0, False),
    (dict(preset="quality", tau_delete=0.5, tau_insert=0.5), Rule(eos=2, dele=9, ins=9), 10.0, True),
    (dict(preset="m2t", tau_delete=0.5, tau_insert=0.5, temperature=1.0), Rule(eos=2, dele=12, ins=7), 6.0, True),
    # Multi-Block Editing: its passes run eagerly, the blocks they change are refilled into the step's cache
    (dict(preset="quality", mbe_window=2), Rule(eos=2), 10.0, False),
    (dict(preset="m2t", mbe_window=1, mbe_max_passes=3, stop_at_eos=False), Rule(eos=2, edit=True), 10.0, False),
    # the repetition penalty (12 > the margin 10) turns a candidate equal to the token before it into another
    (dict(preset="quality", repetition_penalty=12.0), Rule(eos=2, mod=31), 10.0, False),
]
MBE_CASES = {i for i, c in enumerate(CASES) if c[0].get("mbe_window")}


def _decode(case, static, max_batch):
    """case: an index of CASES, or a case tuple of its own."""
    opts, rule, margin, lev = CASES[case] if isinstance(case, int) else case
    opts = dict(opts)
    cfg = DecodeConfig.preset(opts.pop("preset"), max_new_tokens=18, compiled_step=static, **opts)
    model = StubLM(rule, margin=margin, lev=lev)
    engine = Engine(model, cfg, max_batch=max_batch, canvas_len=48)
    engine.iterations = 0  # scheduler iterations that ran a forward (the eager loop: one model call each)
    forward = engine._forward

    def counted(ready):
        engine.iterations += 1
        return forward(ready)

    engine._forward = counted
    for i, p in enumerate(PROMPTS):
        g = torch.Generator().manual_seed(100 + i) if cfg.temperature > 0 else None
        engine.submit(p, g)
    seqs = engine.run()
    return engine, model, [(s.canvas, s.trace, s.forwards, s.edits, s.deletes, s.inserts, s.lev_drafts,
                            s.block_versions, s.mbe_edits) for s in seqs]


@pytest.mark.parametrize("max_batch", [2, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_compiled_step_decodes_what_the_eager_loop_decodes(case, max_batch):
    eager, eager_model, want = _decode(case, False, max_batch)
    static, model, got = _decode(case, True, max_batch)
    assert got == want
    assert static.row_forwards == eager.row_forwards
    # the same schedule: MBE rows take their pass in the iteration they are ready, beside the step's block rows
    assert static.iterations == eager.iterations == eager.num_forwards
    if case not in MBE_CASES:  # with MBE the step and the eager MBE rows of one iteration are two model calls
        assert static.num_forwards == eager.num_forwards
    assert static.row_forwards == sum(s.forwards for s in static.sequences)
    # every block iteration ran as the fixed-shape step: all slots, [previous block ; active block]
    steps = [e for e in model.log if e[0] == "StaticKVCache" and e[1] == max_batch]
    assert all(e == ("StaticKVCache", max_batch, 2 * K) for e in steps)
    mbe_passes = sum(e[0] == "NoneType" for e in model.log)  # MBE passes: eager, without a cache
    assert len(steps) + mbe_passes == static.num_forwards and (mbe_passes > 0) == (case in MBE_CASES)
    assert all(e[0] != "StaticKVCache" for e in eager_model.log)


def test_the_cases_take_every_counted_path():
    """The comparison is not vacuous: edits, DELETEs, INSERTs and EOS stops all happen in some case."""
    seen = {"edits": 0, "deletes": 0, "inserts": 0, "drafts": 0, "short": 0, "mbe": 0}
    for case in range(len(CASES)):
        _, _, out = _decode(case, False, 6)
        for _c, _t, _f, edits, deletes, inserts, drafts, _v, mbe in out:
            seen["mbe"] += mbe
            seen["edits"] += edits
            seen["deletes"] += deletes
            seen["inserts"] += inserts
            seen["drafts"] += len(drafts)
    _, _, out = _decode(0, False, 6)
    seen["short"] = sum(len(o[7]) < -(-(len(p) + 18) // K) - len(p) // K for o, p in zip(out, PROMPTS))  # EOS
    penalty = CASES[-1]  # the repetition penalty changes tokens of that case
    unpenalised = (dict(penalty[0], repetition_penalty=0.0), *penalty[1:])
    seen["penalised"] = sum(a[0] != b[0] for a, b in zip(_decode(penalty, False, 6)[2], _decode(unpenalised, False, 6)[2]))
    assert all(v > 0 for v in seen.values()), seen
