"""The rollout engine runs every decoding feature in multi-turn rollouts (DELETE / INSERT, Multi-Block Editing,
block routing, the compiled step, and all of them together), admits sequences into freed slots without changing
their tokens, never rewrites a turn the environment already saw, and lets the process exit past a hung env.step.

The reference for a turn is the single-turn engine on that turn's context (prompt, earlier turns and
observations), with the same settings: a turn is a single-turn rollout whose prompt is its context."""
import subprocess
import sys
import textwrap

import pytest
import torch

import rollout.compiled as compiled
from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from ebpo.core.turns import leaking_blocks
from ebpo.model.loading import load_model_tokenizer
from rollout.config import DecodeConfig
from rollout.decoder import generate
from rollout.multiturn import MultiTurnConfig, generate_multiturn


PROMPTS = [[0, 11, 12], [0] + list(range(20, 27)), [0] + list(range(30, 42)), [0, 50, 51, 52, 53]]


class Recorder:
    """Answers turn k with `obs<k>`; done after `n` turns; keeps the text of every turn it was sent."""

    def __init__(self, n):
        self.n, self.k, self.seen = n, 0, []

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        self.seen.append(text)
        return (f"obs{self.k}", 0.0, self.k >= self.n, {})


def _model(lev=False, routing=0):
    """A random tiny model (vocabulary of the shipped tokenizer's ids); `lev`: DELETE / INSERT made likely."""
    model = make_model(seed=1 if lev else 0)
    if routing:
        model.config.block_routing_capacity = routing
    if lev:
        with torch.no_grad():
            w = model.lm_head.weight
            for tid in (model.config.delete_token_id, model.config.insert_token_id):
                w[tid] += 10.0 * w.mean(0) / w.mean(0).norm() * w[tid].norm()
    return model


@pytest.fixture(scope="module")
def tok():
    return load_model_tokenizer("tiny-sft")


def _run(model, tok, cfg, envs, **kw):
    mt = MultiTurnConfig(max_turn_tokens=24, stop_at_tool_call=False, max_total_tokens=256)
    return generate_multiturn(model, PROMPTS[:len(envs)], envs, cfg, mt, tokenizer=tok, **kw)


FEATURES = {
    "levenshtein": (dict(lev=True), dict(tau_delete=0.2, tau_insert=0.2)),
    "mbe": (dict(), dict(mbe_window=2, mbe_tau=0.2)),
    "routing": (dict(routing=4), dict()),
    "compiled": (dict(), dict(compiled_step=True)),
    "all": (dict(lev=True, routing=4), dict(tau_delete=0.2, tau_insert=0.2, mbe_window=1, mbe_tau=0.3,
                                            compiled_step=True)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_turn_is_the_single_turn_engine_on_its_context(tok, feature, monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE", False)
    model_kw, cfg_kw = FEATURES[feature]
    model = _model(**model_kw)
    cfg = DecodeConfig.preset("speed", **cfg_kw)
    envs = [Recorder(n) for n in (1, 2, 3, 2)]
    trajs = _run(model, tok, cfg, envs)
    K = model.config.block_size
    single = cfg.replace(max_new_tokens=24)
    for tr in trajs:
        assert tr.stop == "done" and not tr.failed
        for turn in tr.turns:
            ref = generate(model, [tr.ids[:turn.start]], single)[0]
            assert tr.ids[turn.start:turn.end] == ref.token_ids + ref.tail_ids
            assert turn.end % K == 0 and all(tr.generated[turn.start:turn.end])
            assert model.config.mask_token_id not in tr.ids[turn.start:turn.end]
        assert not leaking_blocks(torch.tensor([tr.generated]), torch.tensor([tr.segment]), K).any()
    if model_kw.get("lev"):
        assert sum(t.num_deletes + t.num_inserts for t in trajs) > 0
        assert any(t.lev_drafts for t in trajs)
        for t in trajs:  # each draft: a block of the generated part, K tokens
            for off, d in t.lev_drafts:
                assert (len(t.prompt_ids) + off) % K == 0 and len(d) == K


def test_mbe_never_rewrites_a_turn_the_environment_saw(tok):
    """With MBE revising the blocks of the current turn, every turn's final tokens are still the text that went to
    the environment; and MBE did change something (the trajectories differ from MBE off)."""
    model = _model()
    cfg = DecodeConfig.preset("speed", mbe_window=3, mbe_tau=0.2)
    envs = [Recorder(3) for _ in range(4)]
    trajs = _run(model, tok, cfg, envs)
    plain = _run(model, tok, cfg.replace(mbe_window=0), [Recorder(3) for _ in range(4)])
    assert [t.ids for t in trajs] != [t.ids for t in plain]
    eos = model.config.eos_token_id
    for tr, env in zip(trajs, envs):
        assert len(env.seen) == len(tr.turns) == 3
        for turn, sent in zip(tr.turns, env.seen):
            ids = tr.ids[turn.start:turn.end]
            ids = ids[: ids.index(eos)] if eos in ids else ids
            assert tok.decode(ids, skip_special_tokens=True) == sent == turn.text


@pytest.mark.parametrize("cfg_kw", [dict(tau_delete=0.2, tau_insert=0.2),
                                    dict(temperature=1.0, mbe_window=1, mbe_tau=0.3, compiled_step=True)])
def test_trajectories_do_not_depend_on_max_batch(tok, cfg_kw, monkeypatch):
    """Trajectories 4 at once or 1-3 at a time (later ones join freed slots): the same tokens. The scheduler adds
    nothing that depends on the neighbours; what remains is the float rounding of batched CPU kernels, whose
    results for one row can move by about 1e-6 with the row count of the matrix (docs/decoding.md): a decision
    that close to a threshold may then flip, so these settings keep their decisions clear of that."""
    monkeypatch.setattr(compiled, "COMPILE", False)
    model = _model(lev="tau_delete" in cfg_kw)
    cfg = DecodeConfig.preset("speed", **cfg_kw)
    seeds = [3, 4, 5, 6]
    ref = _run(model, tok, cfg, [Recorder(n) for n in (2, 1, 3, 2)], seeds=seeds)
    for mb in (1, 2, 3):
        got = _run(model, tok, cfg, [Recorder(n) for n in (2, 1, 3, 2)], seeds=seeds, max_batch=mb)
        assert [(t.ids, t.generated, t.segment, t.num_edits) for t in got] == \
            [(t.ids, t.generated, t.segment, t.num_edits) for t in ref]


def test_a_hung_env_step_costs_its_timeout_and_the_process_exits():
    """env.step hangs for 10 minutes: the trajectory fails at step_timeout_s, results print, the process exits
    (the abandoned call runs in a daemon thread)."""
    code = textwrap.dedent("""
        import time, torch
        from ebpo.model import LLaDA2MoeModelLM, tiny_config
        from ebpo.model.loading import load_model_tokenizer
        from rollout.config import DecodeConfig
        from rollout.multiturn import MultiTurnConfig, run_episodes

        class Hang:
            def reset(self, row, seed=None):
                return None
            def step(self, text):
                time.sleep(600)

        torch.manual_seed(0)
        model = LLaDA2MoeModelLM(tiny_config()).eval()
        tok = load_model_tokenizer("tiny-sft")
        t0 = time.monotonic()
        trajs = run_episodes(model, [[0, 5, 6]], [{}], Hang, DecodeConfig.preset("speed"),
                             MultiTurnConfig(max_turn_tokens=8, step_timeout_s=1.0), tokenizer=tok)
        print("STOP", trajs[0].stop, round(time.monotonic() - t0, 1), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "STOP env_timeout" in proc.stdout
