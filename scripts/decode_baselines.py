"""Token-identity baselines of the rollout decoder: every preset and feature, single- and multi-turn.

    python scripts/decode_baselines.py record scripts/decode_baselines.json    # on the reference code
    python scripts/decode_baselines.py compare scripts/decode_baselines.json   # after a change

Each case decodes a fixed set of prompts with fixed seeds and keeps everything a sequence reports (tokens,
trace, forwards, edits, edit log, DELETE / INSERT counts, pre-edit drafts, the canvas tail; for multi-turn
rollouts the ids, generated flags, segments and each turn's span, text and stop reason). `compare` re-runs
the cases, with the batch split into several `max_batch` sizes where the engine takes one, and reports
every difference: a sequence's tokens must not depend on which sequences share its forwards or when it was
admitted. Models are the shipped tiny checkpoints and seeded random tiny models (no download).
"""
from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[0, 11], [0] + list(range(20, 27)), [0] + list(range(30, 42)), [0] + list(range(50, 65)), [0, 5, 6],
           [0] + list(range(70, 79))]
SEEDS = [11, 12, 13, 14, 15, 16]


def random_model(seed: int, head_scale: float = 8.0, eos_boost: float = 0.0, lev_boost: float = 0.0,
                 routing: int = 0):
    """A random tiny model with a sharpened head (confidences spread across the thresholds)."""
    from ebpo.model import LLaDA2MoeModelLM, tiny_config

    cfg = tiny_config()
    if routing:
        cfg.block_routing_capacity = routing
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LLaDA2MoeModelLM(cfg).eval()
    with torch.no_grad():
        w = model.lm_head.weight
        w.mul_(head_scale)
        if eos_boost:
            w[cfg.eos_token_id] += eos_boost / w.shape[1] ** 0.5
        if lev_boost:
            for tid in (cfg.delete_token_id, cfg.insert_token_id):
                w[tid] += lev_boost * w.mean(0) / w.mean(0).norm() * w[tid].norm()
    return model


def single_cases():
    """(name, model key, DecodeConfig kwargs incl. preset, sampled?) of the single-turn baselines."""
    out = []
    for preset in ("quality", "speed", "m2t"):
        for temp in (0.0, 1.0):
            for mbe in (0, 2):
                out.append((f"{preset}-t{temp:g}-mbe{mbe}", "rand", dict(preset=preset, temperature=temp,
                                                                       mbe_window=mbe, max_new_tokens=40)))
    out += [
        ("speed-mbe-low-tau", "rand", dict(preset="speed", mbe_window=2, mbe_tau=0.2, max_new_tokens=40)),
        ("quality-t1-mbe-low-tau", "rand", dict(preset="quality", temperature=1.0, mbe_window=1, mbe_tau=0.3,
                                                mbe_max_passes=3, max_new_tokens=40)),
        ("mbe-nocache", "rand", dict(preset="quality", mbe_window=2, mbe_tau=0.3, use_cache=False, max_new_tokens=24)),
        ("quality-penalty-topk", "rand", dict(preset="quality", temperature=0.8, top_k=20, top_p=0.9,
                                              repetition_penalty=3.0, max_new_tokens=40)),
        ("speed-nocache", "rand", dict(preset="speed", use_cache=False, max_new_tokens=24)),
        ("speed-early-commit", "rand", dict(preset="speed", early_commit=0.3, max_new_tokens=40)),
        ("quality-eos", "eos", dict(preset="quality", temperature=1.0, max_new_tokens=40)),
        ("compiled-quality", "rand", dict(preset="quality", compiled_step=True, max_new_tokens=40)),
        ("compiled-speed-t1", "rand", dict(preset="speed", compiled_step=True, temperature=1.0, max_new_tokens=40)),
        ("compiled-eos", "eos", dict(preset="speed", compiled_step=True, temperature=1.0, max_new_tokens=40)),
        ("lev-greedy", "lev", dict(preset="quality", tau_delete=0.2, tau_insert=0.2, max_new_tokens=40)),
        ("lev-sampled", "lev", dict(preset="speed", tau_delete=0.15, tau_insert=0.15, temperature=1.0,
                                    max_lev_edits=3, max_new_tokens=40)),
        ("lev-mbe", "lev", dict(preset="quality", tau_delete=0.2, tau_insert=None, mbe_window=2, max_new_tokens=40)),
        ("routing-quality", "routing", dict(preset="quality", temperature=1.0, max_new_tokens=40)),
        ("routing-speed-mbe", "routing", dict(preset="speed", mbe_window=1, max_new_tokens=40)),
        ("sft-quality", "sft", dict(preset="quality", max_new_tokens=48)),
        ("sft-speed-t1", "sft", dict(preset="speed", temperature=1.0, max_new_tokens=48)),
    ]
    return out


def models():
    from ebpo.model.loading import load_model

    return {"rand": random_model(0), "eos": random_model(0, eos_boost=4.0), "lev": random_model(1, lev_boost=10.0),
            "routing": random_model(2, routing=4), "sft": load_model("tiny-sft").eval()}


def _sft_prompts():
    from ebpo.infra.data import encode_prompt
    from ebpo.model.loading import load_model_tokenizer

    tok = load_model_tokenizer("tiny-sft")
    return [encode_prompt(tok, q) for q in ["Compute 12+7.", "Compute 45-3.", "What is 6 times 7?",
                                            "Compute 128+256.", "Write f(x): add 2 to x.", "Compute 9*9."]]


def _record_outputs(outs) -> list[dict]:
    return [dict(token_ids=o.token_ids, trace=o.trace, num_forwards=o.num_forwards, num_edits=o.num_edits,
                 num_mbe_edits=o.num_mbe_edits, tail_ids=o.tail_ids, edit_log=[list(e) for e in o.edit_log],
                 num_deletes=o.num_deletes, num_inserts=o.num_inserts,
                 lev_drafts=[[off, list(d)] for off, d in o.lev_drafts], finished_by_eos=o.finished_by_eos)
            for o in outs]


def run_single(ms, max_batch: int | None) -> dict:
    from rollout import DecodeConfig, generate
    from rollout import compiled

    compiled.COMPILE = False  # the fixed-shape step, run eagerly: same algorithm, no compile time
    takes_max_batch = "max_batch" in inspect.signature(generate).parameters
    res = {}
    for name, key, kw in single_cases():
        kw = dict(kw)
        cfg = DecodeConfig.preset(kw.pop("preset"), **kw)
        prompts = _sft_prompts() if key == "sft" else PROMPTS
        extra = {"max_batch": max_batch} if (takes_max_batch and max_batch) else {}
        outs = generate(ms[key], prompts, cfg, seeds=SEEDS if cfg.temperature > 0 else None, **extra)
        res[name] = _record_outputs(outs)
    return res


class Scripted:
    """Answers every turn with `obs<k>`; done after `n` turns."""

    def __init__(self, n):
        self.n, self.k = n, 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        return (f"obs{self.k}", 0.25, self.k >= self.n, {})


def _traj_record(t) -> dict:
    return dict(ids=t.ids, generated=t.generated, segment=t.segment, stop=t.stop, failed=t.failed,
                num_forwards=t.num_forwards, env_reward=t.env_reward,
                turns=[dict(start=u.start, end=u.end, text=u.text, finished_by=u.finished_by, forwards=u.forwards,
                            obs_start=u.obs_start, obs_end=u.obs_end) for u in t.turns])


def run_multi(max_batch: int | None) -> dict:
    from ebpo.infra.data import encode_prompt
    from ebpo.model.loading import load_model, load_model_tokenizer
    from rewards.envs import make_environment
    from rollout.config import DecodeConfig
    from rollout.multiturn import MultiTurnConfig, generate_multiturn, run_episodes

    takes_max_batch = "max_batch" in inspect.signature(generate_multiturn).parameters
    extra = {"max_batch": max_batch} if (takes_max_batch and max_batch) else {}
    res = {}
    model, tok = load_model("tiny-sft").eval(), load_model_tokenizer("tiny-sft")
    qs = ["Compute 12+7.", "Compute 45-3.", "Write f(x): add 2 to x.", "Compute 9*9."]
    prompts = [encode_prompt(tok, q) for q in qs]
    for name, kw in [("scripted-quality", dict(preset="quality")),
                     ("scripted-speed-t1", dict(preset="speed", temperature=1.0))]:
        kw = dict(kw)
        cfg = DecodeConfig.preset(kw.pop("preset"), **kw)
        envs = [Scripted(n) for n in (1, 2, 3, 2)]
        trajs = generate_multiturn(model, prompts, envs, cfg, MultiTurnConfig(max_turn_tokens=24,
                                                                               stop_at_tool_call=False),
                                   tokenizer=tok, seeds=[1, 2, 3, 4] if cfg.temperature > 0 else None, **extra)
        res[name] = [_traj_record(t) for t in trajs]
    agent, atok = load_model("tiny-agent").eval(), load_model_tokenizer("tiny-agent")
    rows = [json.loads(x) for x in Path("examples/data/agent_eval.jsonl").read_text().splitlines()[:8]]
    aprompts = [encode_prompt(atok, r["prompt"]) for r in rows]
    for name, kw, seeds in [("agent-greedy", dict(preset="quality"), [0] * len(rows)),
                            ("agent-sampled", dict(preset="quality", temperature=1.0), list(range(len(rows))))]:
        kw = dict(kw)
        cfg = DecodeConfig.preset(kw.pop("preset"), **kw)
        trajs = run_episodes(agent, aprompts, rows, lambda: make_environment("calculator", {}), cfg,
                             MultiTurnConfig(), tokenizer=atok, seeds=seeds, **extra)
        res[name] = [_traj_record(t) for t in trajs]
    return res


def run_all(max_batch: int | None) -> dict:
    torch.set_num_threads(1)
    return {"single": run_single(models(), max_batch), "multi": run_multi(max_batch)}


def diff(base: dict, new: dict, label: str) -> int:
    bad = 0
    for part in base:
        for case, seqs in base[part].items():
            got = new[part].get(case)
            if got is None:
                print(f"{label} {part}/{case}: missing")
                bad += 1
                continue
            for i, (a, b) in enumerate(zip(seqs, got)):
                keys = [k for k in a if a[k] != b.get(k)]
                if keys:
                    print(f"{label} {part}/{case}[{i}]: differs in {keys}")
                    bad += 1
    return bad


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in {"record", "compare"}:
        print(__doc__)
        return 2
    path = Path(argv[1])
    if argv[0] == "record":
        t0 = time.time()
        path.write_text(json.dumps(run_all(None)))
        print(f"recorded {path} in {time.time() - t0:.0f} s")
        return 0
    base = json.loads(path.read_text())
    bad = 0
    for mb in (None, 2, 3):
        t0 = time.time()
        got = run_all(mb)
        n = diff(base, got, f"max_batch={mb}")
        cases = sum(len(v) for v in base.values())
        print(f"max_batch={mb}: {cases} cases, {'identical' if n == 0 else f'{n} differences'} "
              f"({time.time() - t0:.0f} s)")
        bad += n
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
