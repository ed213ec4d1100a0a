"""What the compiled step's slots (`rollout.static_slots`, run eagerly) compute besides the step, against the rules
in its docstring: each eager `refill` forward covers exactly the blocks it names, once, block-causally, and without
the LM head; and a block's end costs no read of the canvas back to the host (the step's own EOS flag is used).
The decoded tokens are checked elsewhere (test_static_slots_mt40.py); a refill of too many or too few blocks or an
extra host read decodes the same tokens, so only these checks see them (issue 40's survivors of static_slots.py)."""
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
from stub_model_mt40 import K, Rule, ScriptEnv, StubLM, StubTokenizer
from test_engine_details_mt40 import exported_at_a_boundary
from test_static_slots_mt40 import CASES, MBE_CASES, PROMPTS


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


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
