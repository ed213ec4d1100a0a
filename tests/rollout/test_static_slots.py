"""The compiled step's slots (`rollout.static_slots`, the `CompiledRunner`, run eagerly:
`rollout.compiled.COMPILE = False`), on the stub model whose two layers make any missing or stale key in the
fixed-size cache change the tokens:

* they decode what the eager loop decodes, bit for bit (their documented contract): tokens, traces, forwards,
  T2T edits, DELETE / INSERT counts and L-EBPO drafts, with greedy and sampled decoding, single-turn and
  multi-turn (turns resumed after an observation);
* what they compute besides the step, against the rules in the module's docstring: each eager `refill` forward
  covers exactly the blocks it names, once, block-causally, without the LM head; and a block's end reads no
  canvas back to the host (the step's own EOS flag is used). A refill of too many or too few blocks, or an extra
  host read, decodes the same tokens, so only these checks see them;
* every tensor stays on the model's device: the engine decodes under a `meta` default device exactly what it
  decodes without one (the model and generators built on the CPU first, as a GPU user's are on the GPU; a tensor
  the slots create without the model's device would land on `meta` and fail where it meets the CPU canvas)."""
import contextlib

import pytest
import torch

import rollout.compiled as compiled
import rollout.engine as engine_mod
import rollout.lifecycle as lifecycle
import rollout.static_slots as static_slots
from ebpo.model.cache import StaticKVCache
from rollout.config import DecodeConfig
from rollout.engine import Engine
from rollout.multiturn import MultiTurnConfig, TurnDriver, generate_multiturn
from rollout.sequence import FINISHED
from tests.support.stub_lm import K, Rule, ScriptEnv, StubLM, StubTokenizer, exported_at_a_boundary


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
    # a model trained for Levenshtein editing, decoding without it: DELETE / INSERT are plain tokens then
    (dict(preset="quality"), Rule(eos=2, dele=9, ins=9), 10.0, True),
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


# multi-turn: (decode options, rule, stub margin, lev); turns resume after observations of several lengths
MT_CASES = [
    (dict(preset="m2t"), Rule(eos=4, tool=6, c=3), 10.0, False),
    (dict(preset="quality", temperature=1.0), Rule(eos=4, tool=6, edit=True), 4.0, False),
    (dict(preset="quality", tau_delete=0.5, tau_insert=0.5), Rule(eos=2, tool=4, dele=9, ins=9), 10.0, True),
]
MT_PROMPTS = [[(5 * i + 3 * j + 1) % 30 for j in range(n)] for i, n in enumerate([13, 9, 2, 17, 6])]


def _multiturn(case: int, static: bool) -> list[tuple]:
    """Every trajectory of MT_CASES[case] over MT_PROMPTS (two slots, so slots are reused) and the texts each
    environment saw."""
    opts, rule, margin, lev = MT_CASES[case]
    opts = dict(opts)
    cfg = DecodeConfig.preset(opts.pop("preset"), compiled_step=static, **opts)
    mt = MultiTurnConfig(max_turns=4, max_turn_tokens=7, max_total_tokens=96,
                         observation_template="<o>{observation}</o>")
    envs = [ScriptEnv(4, obs=(6, 1, 11)) for _ in MT_PROMPTS]
    seeds = list(range(100, 100 + len(MT_PROMPTS))) if cfg.temperature > 0 else None
    trajs = generate_multiturn(StubLM(rule, margin=margin, lev=lev), MT_PROMPTS, envs, cfg, mt,
                               tokenizer=StubTokenizer(), seeds=seeds, max_batch=2)
    return [(tr.ids, tr.generated, tr.segment, tr.stop, tr.num_forwards, tr.num_edits, tr.num_deletes,
             tr.num_inserts, tr.lev_drafts, env.texts,
             [(t.start, t.end, t.text, t.finished_by, t.forwards, t.obs_start, t.obs_end) for t in tr.turns])
            for tr, env in zip(trajs, envs)]


@pytest.mark.parametrize("case", range(len(MT_CASES)))
def test_the_compiled_step_decodes_multi_turn_rollouts_as_the_eager_loop(case):
    """A turn resumed after its observation decodes in the step's cache what the eager loop decodes: every
    token, turn boundary, stop, forward count, edit count and draft, and the text each environment saw."""
    want = _multiturn(case, False)
    assert _multiturn(case, True) == want
    assert sum(len(tr[-1]) - 1 for tr in want) >= 6  # turns resumed after an observation
    if case == 1:
        assert sum(tr[5] for tr in want) > 0  # T2T edits ran
    if case == 2:
        assert sum(tr[6] + tr[7] for tr in want) > 0 and any(tr[8] for tr in want)  # DELETE / INSERT and drafts


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


# what the slots compute besides the step

class RefillLog:
    """Records every eager forward that `CompiledRunner.refill` makes: (sequence id, positions, logits computed),
    the sequence taken from the refill call the forward happens in (any other forward is the step's)."""

    def __init__(self, monkeypatch, model):
        self.calls: list[tuple[int, list[int], bool]] = []
        self.current = None
        refill = static_slots.CompiledRunner.refill

        def recording_refill(runner, s, from_block, to_block=None):
            self.current = s.id
            try:
                return refill(runner, s, from_block, to_block)
            finally:
                self.current = None

        monkeypatch.setattr(static_slots.CompiledRunner, "refill", recording_refill)

        def hook(_module, args, kwargs, out):
            if self.current is None:
                return
            assert isinstance(kwargs["cache"], StaticKVCache) and kwargs["input_ids"].shape[0] == 1
            self.calls.append((self.current, kwargs["position_ids"][0].tolist(), out.logits is not None))

        model.register_forward_hook(hook, with_kwargs=True)

    def of(self, sid: int) -> list[list[int]]:
        return [pos for s, pos, _ in self.calls if s == sid]


def _block_range(lo_block: int, hi_block: int) -> list[list[int]]:
    """The one forward a refill of blocks [lo_block, hi_block) makes, or none for an empty range."""
    return [list(range(lo_block * K, hi_block * K))] if hi_block > lo_block else []


@pytest.mark.parametrize("max_batch", [1, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_refills_cover_the_documented_blocks_once_without_the_head(case, max_batch, monkeypatch):
    """Admission: the prompt's blocks before the one preceding its active block (the step recomputes that one);
    after an MBE pass that changed tokens: from the earliest changed block up to the block that ended."""
    opts, rule, margin, lev = CASES[case]
    opts = dict(opts)
    cfg = DecodeConfig.preset(opts.pop("preset"), max_new_tokens=18, compiled_step=True, **opts)
    model = StubLM(rule, margin=margin, lev=lev)
    log = RefillLog(monkeypatch, model)
    mbe = []  # (sequence, earliest changed block, ended block) of each MBE window that changed tokens
    mbe_over = lifecycle.after_mbe

    def recording_mbe_over(engine, s):
        if s.mbe_first_changed is not None:
            mbe.append((s.id, s.mbe_first_changed, s.block))
        return mbe_over(engine, s)

    monkeypatch.setattr(engine_mod, "after_mbe", recording_mbe_over)  # the engine's own name for it
    engine = Engine(model, cfg, max_batch=max_batch, canvas_len=48)
    for i, p in enumerate(PROMPTS):
        engine.submit(p, torch.Generator().manual_seed(100 + i) if cfg.temperature > 0 else None)
    engine.run()
    for s, p in zip(engine.sequences, PROMPTS):
        want = _block_range(0, len(p) // K - 1)
        for sid, first, ended in mbe:
            if sid == s.id:
                want += _block_range(first, ended)
        assert log.of(s.id) == want, (s.id, len(p))
    assert not any(head for _, _, head in log.calls)
    assert len(log.calls) >= 3 and (len(mbe) > 0) == (case in MBE_CASES)


def test_a_prompt_inside_its_second_block_needs_no_refill(monkeypatch):
    """P in [K, 2K): the active block is 1 and the step recomputes block 0, so nothing is refilled (not even an
    empty forward)."""
    model = StubLM(Rule(eos=3))
    log = RefillLog(monkeypatch, model)
    engine = Engine(model, DecodeConfig.preset("quality", max_new_tokens=8, compiled_step=True), max_batch=2,
                    canvas_len=24)
    for n in range(K, 2 * K):
        engine.submit(list(range(1, n + 1)))
    engine.run()
    assert log.calls == [] and model.calls > 0


def test_a_resumed_turn_refills_from_the_last_turn_s_final_block(monkeypatch):
    """After an observation the turn goes on from `start`: blocks [last turn's final block, start's block - 1)
    are refilled (the final block's keys were computed before its last tokens were written)."""
    rule = Rule(eos=4, tool=6, c=3)
    mt = MultiTurnConfig(max_turns=4, max_turn_tokens=6, max_total_tokens=96, observation_template="<o>{observation}</o>")
    lens, obs = [13, 9, 2, 17], (6, 1, 11)
    prompts = [[(5 * i + 3 * j + 1) % 30 for j in range(n)] for i, n in enumerate(lens)]
    model = StubLM(rule)
    log = RefillLog(monkeypatch, model)
    trajs = generate_multiturn(model, prompts, [ScriptEnv(4, obs=obs) for _ in prompts],
                               DecodeConfig.preset("m2t", compiled_step=True), mt, tokenizer=StubTokenizer(),
                               max_batch=2)
    resumed = 0
    for sid, (p, tr) in enumerate(zip(prompts, trajs)):
        want = _block_range(0, len(p) // K - 1)
        for before, after in zip(tr.turns, tr.turns[1:]):
            want += _block_range(before.end // K - 1, after.start // K - 1)
            resumed += 1
        assert log.of(sid) == want, sid
    assert resumed >= 6 and not any(head for _, _, head in log.calls)


@pytest.mark.parametrize("waiting", [False, True])
def test_an_adopted_sequence_is_refilled_up_to_its_step_window(waiting, monkeypatch):
    """Adopt (engine.py): a sequence decoding a block gets blocks [0, block - 1); one waiting on its environment
    gets the blocks before its last turn's final block, which `resume` refills with the observation."""
    cfg = DecodeConfig.preset("m2t", max_new_tokens=30, compiled_step=True)
    model = StubLM(Rule(eos=0, tool=0, c=2))
    first, s, mt, tok = exported_at_a_boundary(model, cfg, waiting, latency=0.3)
    log = RefillLog(monkeypatch, model)
    second = TurnDriver(model, cfg, max_batch=2, canvas_len=80, tokenizer=tok, mt=mt, env_runner=first.env_runner)
    (second if waiting else second.engine).adopt(s)  # a single-turn sequence is the engine's own
    want = _block_range(0, s.turns[-1].end // K - 1) if waiting else _block_range(0, s.block - 1)
    assert log.of(s.id) == want and len(want[0]) >= 2 * K
    second.run()
    assert s.status == FINISHED


def test_a_block_s_end_reads_no_canvas_back(monkeypatch):
    """The step reports whether the generated region holds EOS (its outcome row, the iteration's one host read);
    a single-turn block's end uses that flag and never reads the canvas to look for EOS itself, as the eager
    path does."""
    reads = []
    first_eos = lifecycle.first_eos

    def counting(tokens, eos_ids):
        reads.append(len(tokens))
        return first_eos(tokens, eos_ids)

    monkeypatch.setattr(lifecycle, "first_eos", counting)  # where a block's end looks for EOS
    for case in sorted(set(range(len(CASES))) - MBE_CASES):  # an MBE window's end is decided by the eager
        # pass, which reads the canvas
        opts, rule, margin, lev = CASES[case]
        opts = dict(opts)
        preset = opts.pop("preset")
        for static in (False, True):
            cfg = DecodeConfig.preset(preset, max_new_tokens=18, compiled_step=static, **opts)
            engine = Engine(StubLM(rule, margin=margin, lev=lev), cfg, max_batch=3, canvas_len=48)
            for i, p in enumerate(PROMPTS):
                engine.submit(p, torch.Generator().manual_seed(100 + i) if cfg.temperature > 0 else None)
            reads.clear()
            seqs = engine.run()
            blocks = sum(len(s.block_versions) for s in seqs)
            assert len(reads) == (0 if static else blocks), (case, static)


# the model's device

def _run(case: int, max_batch: int, default_device: str | None, compiled_step: bool = True):
    """The sequences' outcomes of CASES[case] on the stub, the engine built and run under `default_device`."""
    opts, rule, margin, lev = CASES[case]
    opts = dict(opts)
    cfg = DecodeConfig.preset(opts.pop("preset"), max_new_tokens=18, compiled_step=compiled_step, **opts)
    model = StubLM(rule, margin=margin, lev=lev)
    gens = [torch.Generator().manual_seed(100 + i) if cfg.temperature > 0 else None for i in range(len(PROMPTS))]
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        engine = Engine(model, cfg, max_batch=max_batch, canvas_len=48)  # its canvas and static cache too
        for p, g in zip(PROMPTS, gens):
            engine.submit(p, g)
        seqs = engine.run()
    return [(s.canvas, s.trace, s.forwards, s.edits, s.deletes, s.inserts, s.lev_drafts, s.mbe_edits)
            for s in seqs]


@pytest.mark.parametrize("max_batch", [2, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_slots_decode_the_same_under_a_meta_default_device(case, max_batch):
    assert _run(case, max_batch, "meta") == _run(case, max_batch, None)
