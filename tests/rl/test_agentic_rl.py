"""Agentic RL through real Ray actors: multi-turn rollouts against an environment whose tools and steps
misbehave (a tool that hangs, an environment step that raises, one that hangs) train to the end, at
max_staleness 0 and 1, with the failures counted in the agent/* metrics and the trajectories tabled."""
import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ebpo.infra.config import load_config  # noqa: E402
from ebpo.rl.config import RLConfig  # noqa: E402
from tests.support.ray_runs import ray_local  # noqa: E402,F401  (an embedded instance, never a `ray start` cluster)

ENV = '''
import time
from rewards.envs import Tool, ToolEnv
from rewards.envs.calculator import answer_matches, calc as exact_calc


def calc(expr: str) -> str:
    """The calculator, except that a product of an odd number never returns."""
    if int(expr.split("*")[0].strip() or 0) % 2:
        time.sleep(30)
    return exact_calc(expr)


class Misbehaving(ToolEnv):
    def step(self, turn):
        mode = self.row.get("mode")
        if mode == "crash":
            raise RuntimeError("environment bug")
        if mode == "hang":
            time.sleep(20)
        return super().step(turn)


def make(max_turns=3):
    return Misbehaving([Tool(calc, timeout_s=0.5)], score=answer_matches, max_turns=max_turns)
'''


@pytest.fixture
def agent_data(tmp_path):
    rows = [{"prompt": "Compute 482*37.", "answer": str(482 * 37), "mode": "ok"},
            {"prompt": "Compute 483*37.", "answer": str(483 * 37), "mode": "ok"},  # the tool hangs
            {"prompt": "Compute 250*19.", "answer": str(250 * 19), "mode": "crash"},
            {"prompt": "Compute 640*21.", "answer": str(640 * 21), "mode": "hang"}]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    held = tmp_path / "eval.jsonl"
    held.write_text("\n".join(json.dumps(r) for r in rows[:2]))
    (tmp_path / "env.py").write_text(ENV)
    return tmp_path


@pytest.mark.parametrize("staleness", [0, 1])
def test_agentic_rl_survives_misbehaving_tools(ray_local, agent_data, tmp_path, staleness):  # noqa: F811
    from ebpo.rl.trainer import make_loop

    run_dir = tmp_path / "run"
    cfg = load_config(RLConfig, None, [
        "model=tiny-agent", f"data.train={agent_data / 'train.jsonl'}", f"data.eval={agent_data / 'eval.jsonl'}",
        f"env.name={agent_data / 'env.py'}:make", "env.turns={max_turn_tokens: 96, max_total_tokens: 320, "
        "step_timeout_s: 2.0}", "reward.fns=[{fn: task_completion}, {fn: tool_call_validity, weight: 0.2, judge: false}]",
        "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.preset=quality",
        "rollout.decode={temperature: 1.0}", "data.shuffle=false", "trainer.steps=2", "trainer.eval_every=2",
        f"trainer.max_staleness={staleness}", f"trainer.run_dir={run_dir}", "trainer.tracking=none",
        "trainer.progress=false", "trainer.plots=false", "reward.num_workers=1", "rollout.num_threads=1",
        "learner.lr=1e-4"])
    loop = make_loop(cfg)
    try:
        history = loop.fit()
    finally:
        loop.close()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["agent/stop/env_error"] == 2 and h["agent/stop/env_timeout"] == 2  # one group of each
        assert h["agent/failed_count"] == 4 and h["reward/errors"] == 0
        assert "actor/pg_loss" in h, "the learner trained on the multi-turn samples"
    assert sum(h["agent/tool_timeouts"] for h in history) > 0, "the hanging tool timed out, counted"
    assert max(h["reward/task_completion/mean"] for h in history) > 0, "the working rows are solved"
    assert 0 <= history[-1]["eval/accuracy"] <= 1 and "eval/agent/tool_calls" in history[-1]
    tables = [json.loads(x) for x in (Path(run_dir) / "tables" / "trajectories.jsonl").read_text().splitlines()]
    assert tables and all(t["trajectory"].startswith("[turn 1") for t in tables)
