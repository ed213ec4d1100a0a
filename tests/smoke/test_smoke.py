"""The drift smoke: one short check of each place where an upstream release can break us.

Run by `scripts/check-latest.sh` in a throw-away environment with the newest versions pyproject.toml
allows (and by `python -m pytest -m smoke` anywhere); excluded from the default suite, which covers the
same code in depth. Each test is one named step of that script: keep them few, quick and end to end.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.smoke
ROOT = Path(__file__).resolve().parents[2]


def _tiny_model(seed: int = 0):
    from ebpo.model import LLaDA2MoeModelLM, tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LLaDA2MoeModelLM(tiny_config(block_size=4)).eval()


def test_model_forward_cache_and_save_load(tmp_path):
    """Block-by-block decoding against the prefix KV cache equals one block-causal forward, and a
    save_pretrained / AutoModelForCausalLM.from_pretrained round trip gives the same logits."""
    from transformers import AutoModelForCausalLM

    from ebpo.model import BlockKVCache

    model = _tiny_model()
    K = model.config.block_size
    ids = torch.randint(0, model.config.mask_token_id, (1, 3 * K))
    with torch.no_grad():
        full = model(ids).logits
        cache = BlockKVCache.for_model(model.config, batch_size=1, max_len=3 * K)
        pieces = []
        for b in range(3):
            out = model(ids[:, b * K:(b + 1) * K], position_ids=torch.arange(b * K, (b + 1) * K), cache=cache)
            cache.commit(K)
            pieces.append(out.logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)
        model.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(loaded(ids).logits, full, rtol=0, atol=0)


def test_decode_shipped_model():
    """The README's example: the shipped tiny-sft model answers 41+27 under greedy Quality Mode."""
    from ebpo.model.loading import load_model, load_model_tokenizer
    from rollout import DecodeConfig, generate

    model = load_model("tiny-sft").eval()
    tok = load_model_tokenizer("tiny-sft")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute 41+27."}],
                                     add_generation_prompt=True, tokenize=False)
    (out,) = generate(model, [prompt], DecodeConfig.preset("quality", max_new_tokens=32), tokenizer=tok)
    assert "\\boxed{68}" in out.text, out.text
    assert out.num_forwards > 0


def test_one_reward_of_each_kind():
    """math (math-verify), code (sandboxed execution), format and decode_cost through the RewardWorker's
    process pool, each right on an honest sample and wrong on a bad one."""
    from rewards import RewardWorker

    code = "```python\ndef add(a, b):\n    return a + b\n```"
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    cases = [
        ("math", {"completion": "so \\boxed{68}", "answer": "68"}, {"completion": "\\boxed{67}", "answer": "68"}),
        ("code", {"completion": code, "tests": tests},
         {"completion": code.replace("a + b", "a - b"), "tests": tests}),
        ("format_boxed", {"completion": "\\boxed{1}"}, {"completion": "1"}),
    ]
    for name, good, bad in cases:
        with RewardWorker([name], num_workers=1, timeout_s=60) as worker:
            scores = [r["score"] for r in worker.score([good, bad])]
        assert scores[0] == 1.0 and scores[1] < 1.0, (name, scores)
    with RewardWorker(["decode_cost"], num_workers=1, timeout_s=60) as worker:
        (res,) = worker.score([{"completion": "x", "metadata": {"decode": {"forwards": 6, "tokens": 3}}}])
    assert res["score"] == pytest.approx(-2.0), res


def _quickstart_step(tmp_path, *extra: str) -> list[dict]:
    """One RL step of the quickstart recipe through the CLI (local Ray, W&B offline); its metrics."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ebpo", "train", "recipes/quickstart.yaml", "trainer.steps=1",
           "trainer.eval_size=8", "rollout.prompts_per_step=4", "rollout.group_size=2",
           "trainer.dynamic_sampling=0", "trainer.progress=false", "trainer.plots=false",
           f"trainer.run_dir={run}", *extra]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 1 for r in rows), rows
    return rows


def test_rl_step_through_ray(tmp_path):
    """One RL step end to end: rollout, reward and learner actors on a local Ray instance."""
    rows = _quickstart_step(tmp_path)
    step = [r for r in rows if r.get("step") == 1][-1]
    assert all(k in step for k in ("reward/mean", "actor/pg_loss", "eval/math/accuracy")), sorted(step)


def test_learner_update_two_ranks_gloo(tmp_path):
    """One RL step whose learner is two data-parallel ranks in a gloo group."""
    rows = _quickstart_step(tmp_path, "learner.num_workers=2")
    step = [r for r in rows if r.get("step") == 1][-1]
    assert torch.isfinite(torch.tensor(step["actor/grad_norm"])), step
