"""Agent RL through the gateway (`env.agent`): the calculator task trained through an agent function that uses
the real `openai` client follows the native environment path step for step (same seeds: same rewards, same
held-out success), the learner training on the gateway's samples; and a bad agent reference stops the run at
start-up."""
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("openai")

from ebpo.infra.config import load_config  # noqa: E402
from ebpo.rl.config import RLConfig  # noqa: E402
from tests.support.ray_runs import ray_local  # noqa: E402,F401  (an embedded instance, never a `ray start` cluster)

COMMON = ["model=tiny-agent", "data.train=examples/data/agent_train.jsonl", "data.eval=examples/data/agent_eval.jsonl",
          "env.turns={max_turns: 3, max_turn_tokens: 96, max_total_tokens: 320, step_timeout_s: 30.0}",
          "reward.fns=[{fn: task_completion}, {fn: turn_format, weight: 0.1, judge: false}]",
          "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.preset=quality",
          "rollout.decode={temperature: 1.0}", "trainer.steps=2", "trainer.eval_every=2", "trainer.eval_size=24",
          "trainer.tracking=none", "trainer.progress=false", "trainer.plots=false", "reward.num_workers=1",
          "rollout.num_threads=1", "learner.lr=5e-5", "learner.n_draws=2", "learner.packed=true"]
NATIVE = ["env.name=calculator", "env.kwargs={max_turns: 3}"]
AGENT = ["env.agent=examples/agents/calculator_agent.py:calculator_agent", "env.kwargs={max_turns: 3}"]


def _fit(overrides, run_dir):
    from ebpo.rl.trainer import make_loop

    loop = make_loop(load_config(RLConfig, None, COMMON + overrides + [f"trainer.run_dir={run_dir}"]))
    try:
        return loop.fit()
    finally:
        loop.close()


@pytest.mark.slow
def test_agent_function_rl_matches_the_native_environment_path(ray_local, tmp_path):  # noqa: F811
    native = _fit(NATIVE, tmp_path / "native")
    agent = _fit(AGENT, tmp_path / "agent")
    keys = ["reward/mean", "reward/task_completion/mean", "agent/turns", "response_length/mean"]
    for n, a in zip(native, agent):
        assert {k: n[k] for k in keys} == {k: a[k] for k in keys}, "the same trajectories, step for step"
        assert "actor/pg_loss" in a, "the learner trained on the gateway's samples"
    assert native[-1]["eval/accuracy"] == agent[-1]["eval/accuracy"]
    assert 0 < agent[-1]["eval/accuracy"] < 1


def test_a_bad_agent_reference_stops_the_run_at_start_up(tmp_path):
    from ebpo.rl.setup import check
    from ebpo.serve.agents import AgentLoadError

    with pytest.raises(AgentLoadError, match="no async function"):
        check(load_config(RLConfig, None, COMMON + ["env.agent=examples/agents/calculator_agent.py:turn_text",
                                                    f"trainer.run_dir={tmp_path}"]))
    with pytest.raises(ValueError, match="not both"):
        load_config(RLConfig, None, COMMON + NATIVE + ["env.agent=examples/agents/calculator_agent.py:calculator_agent"])


FORKING_AGENT = '''
async def forking(client, row):
    """Asks the row's question, then rewrites the history: two segments per episode."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Compute 6*7."}])
    text = r.choices[0].message.content or ""
    return {"reward": float("42" in text) + 0.01 * len(text)}
'''


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["segments", "turns"])
def test_forked_episodes_train_every_segment(ray_local, tmp_path, norm):  # noqa: F811
    (tmp_path / "forking.py").write_text(FORKING_AGENT)
    history = _fit([f"env.agent={tmp_path / 'forking.py'}:forking", f"env.episode_norm={norm}",
                    "trainer.filter_zero_std=false", "trainer.eval_every=0", "data.eval=null"], tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2]
    assert all("actor/pg_loss" in h for h in history), "the learner updated on batches holding both segments"
