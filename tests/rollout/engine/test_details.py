"""Engine rules that decoding the right tokens does not show:

- every tensor the engine writes stays on the model's device in the multi-turn paths (observations appended)
  and in `adopt` (a canvas and trace copied in): run under a `meta` default device with the model on the CPU,
  as the single-turn decodes are (the last test, on test_static_slots.py's cases with the eager step);
- the slot tensors have the dtypes `SlotTensors` documents;
- a multi-turn prompt needs room for one generated token, not more;
- the progress line is one carriage-returned line, rewritten in place, and a newline at the end."""
import contextlib
import re

import pytest
import torch

import rollout.compiled as compiled
from rollout.config import DecodeConfig
from rollout.engine import Engine
from rollout.multiturn import MultiTurnConfig, TurnDriver, generate_multiturn
from test_multiturn import SCENARIOS, SHORT, _prompt
from test_static_slots import CASES, _run
from tests.support.stub_lm import K, Rule, ScriptEnv, StubLM, StubTokenizer, exported_at_a_boundary


@pytest.fixture(autouse=True)
def _eager_compiled_step(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)


def _outcome(trajs):
    """The deterministic part of trajectories (no clocks)."""
    return [(t.ids, t.generated, t.segment, t.stop, t.failed,
             [(u.start, u.end, u.finished_by, u.text, u.observation, u.obs_start, u.obs_end) for u in t.turns])
            for t in trajs]


def _scenario(case: int, default_device: str | None):
    """tests/rollout/test_multiturn.py's SCENARIOS[case] (its decode options, limits, rule and prompts), the model built
    on the CPU and the rollouts run under `default_device`."""
    dec, mt_kw, rule, seqs, max_batch = SCENARIOS[case]
    dec = dict(preset=dec) if isinstance(dec, str) else dict(dec)
    cfg = DecodeConfig.preset(dec.pop("preset", "quality"), **dec)
    mt_kw = {"max_total_tokens": 80, **mt_kw, "observation_template": mt_kw.get("observation_template", SHORT)}
    mt = MultiTurnConfig(**{k: v for k, v in mt_kw.items() if v is not None})
    prompts = [_prompt(i, n) for i, (n, _, _) in enumerate(seqs)]
    envs = [ScriptEnv(n, obs=obs) for _, n, obs in seqs]
    model = StubLM(rule)
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        return generate_multiturn(model, prompts, envs, cfg, mt, tokenizer=StubTokenizer(), max_batch=max_batch)


@pytest.mark.parametrize("case", range(len(SCENARIOS)))
def test_multiturn_rollouts_are_the_same_under_a_meta_default_device(case):
    """The observation ids written into the canvas must be put on the model's device (the CPU here), not the
    default one (meta): otherwise the copy fails where it meets the CPU canvas."""
    want = _outcome(_scenario(case, None))
    assert _outcome(_scenario(case, "meta")) == want
    assert sum(len(t[5]) for t in want) >= 2


def _adopted(waiting: bool, static: bool, default_device: str | None):
    """Decode part of one sequence in a first engine, export it at a block boundary (waiting on its environment,
    or in the middle of a single-turn decode) and finish it in a second engine built under `default_device`."""
    cfg = DecodeConfig.preset("quality", max_new_tokens=30, compiled_step=static)
    model = StubLM(Rule(eos=3, tool=0, c=2))
    first, s, mt, tok = exported_at_a_boundary(model, cfg, waiting, latency=0.05)
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        second = TurnDriver(model, cfg, max_batch=2, canvas_len=80, tokenizer=tok, mt=mt, env_runner=first.env_runner)
        (second if waiting else second.engine).adopt(s)  # a single-turn sequence is the engine's own
        second.run()
    return s.canvas, s.trace, s.stop, [(t.start, t.end, t.text, t.obs_start, t.obs_end) for t in s.turns]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("waiting", [False, True])
def test_an_adopted_sequence_continues_the_same_under_a_meta_default_device(waiting, static):
    """adopt copies the exported canvas and trace into its slot on the model's device."""
    want = _adopted(waiting, static, None)
    assert _adopted(waiting, static, "meta") == want
    assert len(want[0]) > 6 * K and max(want[1]) >= 0  # it decoded on past the exported block


def test_the_slot_tensors_have_their_documented_dtypes():
    """SlotTensors: canvas and trace (B, T) long, post_steps and block_iters (B,) long."""
    for static in (False, True):
        cfg = DecodeConfig.preset("quality", compiled_step=static)
        eng = Engine(StubLM(), cfg, max_batch=3, canvas_len=10)
        sl = eng.runner.slots
        assert [t.dtype for t in (sl.canvas, sl.trace, sl.post_steps, sl.block_iters)] == [torch.long] * 4
        assert sl.canvas.shape == sl.trace.shape == (3, 12) and sl.post_steps.shape == sl.block_iters.shape == (3,)


def test_a_multiturn_prompt_needs_room_for_one_token():
    """A trajectory's first turn needs at least one position after its prompt; a single-turn prompt needs room
    for its max_new_tokens."""
    mt = MultiTurnConfig(max_turns=2, max_turn_tokens=8, max_total_tokens=64, observation_template="<o>{observation}</o>")
    drv = TurnDriver(StubLM(), DecodeConfig.preset("quality", max_new_tokens=5), max_batch=1, canvas_len=16,
                     tokenizer=StubTokenizer(), mt=mt)
    eng = drv.engine
    assert eng.T == 16
    drv.submit([1] * 15, env=ScriptEnv(1))
    with pytest.raises(ValueError, match="a prompt of 16 tokens does not fit the canvas of 16 positions"):
        drv.submit([1] * 16, env=ScriptEnv(1))
    eng.submit([1] * 11)
    with pytest.raises(ValueError, match="a prompt of 12 tokens does not fit the canvas of 16 positions"):
        eng.submit([1] * 12)


def test_the_progress_line_is_rewritten_in_place(capsys):
    """progress=True: after every forward `\\rdecode: <done>/<n> sequences done, <rows> rows in the last forward`
    with no newline, so a terminal shows one line; run() ends it with one newline."""
    eng = Engine(StubLM(Rule(eos=3)), DecodeConfig.preset("quality", max_new_tokens=12), max_batch=2, canvas_len=24,
                 progress=True)
    for n in (3, 7, 5):
        eng.submit(list(range(1, n + 1)))
    eng.run()
    err = capsys.readouterr().err
    assert err.startswith("\r") and err.endswith("\n") and err.count("\n") == 1
    lines = err[1:-1].split("\r")
    pattern = re.compile(r"decode: (\d)/3 sequences done, ([12]) rows in the last forward")
    assert all(pattern.fullmatch(line) for line in lines), lines
    assert len(lines) == eng.num_forwards and lines[-1].startswith("decode: 3/3")


@pytest.mark.parametrize("max_batch", [2, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_eager_engine_decodes_the_same_under_a_meta_default_device(case, max_batch):
    assert _run(case, max_batch, "meta", compiled_step=False) == _run(case, max_batch, None, compiled_step=False)
