"""A user's new tool reaches the model: its name and JSON schema are in the prompt token ids that RL (`ebpo train`
with `env:`), `ebpo eval --env` and `ebpo generate --env` build, through the chat template's `tools=` argument
(ebpo.rl.prompts for RL). The project tokenizer's template renders them; a prompt without tools is what it always
was, and the shipped tiny-agent, whose template has no tools (it was trained without them), keeps its prompts."""
import json
from pathlib import Path

import pytest

from ebpo.infra.config import load_config
from ebpo.infra.data import encode_prompt
from ebpo.model.loading import load_model_tokenizer
from ebpo.model.tokenizer import load_tokenizer
from ebpo.rl.config import RLConfig

ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = '''
from rewards.envs import Tool, ToolEnv


def capital_of(country: str, formal: bool = False) -> str:
    """Capital city."""
    return {"Peru": "Lima"}[country]


def capitals_env(max_turns: int = 2, timeout_s: float = 1.0):
    return ToolEnv([Tool(capital_of, timeout_s=timeout_s)], score=lambda row, final: float(row["answer"] in final),
                   max_turns=max_turns)
'''
PROMPT = "Capital of Peru?"


@pytest.fixture
def env_ref(tmp_path):
    path = tmp_path / "capitals.py"
    path.write_text(ENV_FILE)
    return f"{path}:capitals_env"


def spec_ids(tok, env_ref):
    """Token ids of the tool's function spec as JSON (what a chat template's `tojson` writes), and that JSON."""
    from rewards.envs import make_environment

    function = make_environment(env_ref).specs[0]["function"]
    assert function["name"] == "capital_of" and "country" in function["parameters"]["properties"]
    text = json.dumps(function, ensure_ascii=False)
    return tok(text, add_special_tokens=False)["input_ids"], text


def contains(ids, part):
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def assert_tool_in(ids, tok, env_ref):
    part, text = spec_ids(tok, env_ref)
    assert contains(list(ids), part), tok.decode(ids)
    assert '"name": "capital_of"' in text and '"country": {"type": "string"}' in text
    assert '"formal": {"type": "boolean"}' in text


def test_rl_prompts_carry_the_environments_tools(env_ref, monkeypatch):
    from ebpo.rl.setup import check

    monkeypatch.chdir(ROOT)
    cfg = load_config(RLConfig, ROOT / "recipes" / "quickstart_agent.yaml",
                      ["model=preset:tiny", f"env.name={env_ref}", "trainer.tracking=none"])
    run = check(cfg)
    row = run.train_rows[0]
    ids = run.prompts.encode(row)
    assert_tool_in(ids, run.tokenizer, env_ref)
    plain = encode_prompt(run.tokenizer, row["prompt"])
    assert ids[-len(plain):] == plain  # the tools come first, then the conversation as without them
    # single-turn: no tools, the prompt as it always was
    single = check(load_config(RLConfig, ROOT / "recipes" / "quickstart_agent.yaml",
                               ["model=preset:tiny", "env.name=null", "reward.fns=[{fn: math}]"]))
    assert single.prompts.encode(row) == encode_prompt(run.tokenizer, row["prompt"])


def test_the_shipped_agent_keeps_its_prompts(monkeypatch):
    """tiny-agent's own template has no tools (its SFT data had none): its RL prompts are unchanged."""
    from ebpo.rl.setup import check

    monkeypatch.chdir(ROOT)
    run = check(load_config(RLConfig, ROOT / "recipes" / "quickstart_agent.yaml", ["trainer.tracking=none"]))
    assert run.prompts.tools and run.prompts.tools[0]["function"]["name"] == "calc"
    tok = load_model_tokenizer("tiny-agent")
    row = run.train_rows[0]
    assert run.prompts.encode(row) == encode_prompt(tok, row["prompt"])


def test_eval_prompts_carry_the_environments_tools(env_ref, monkeypatch):
    import rollout.multiturn
    from ebpo.sft.agent_eval import evaluate_agent

    seen = []

    def capture(model, prompts, rows, env_factory, config, mt, tokenizer=None, seeds=None):
        seen.extend(prompts)
        raise StopIteration

    monkeypatch.setattr(rollout.multiturn, "run_episodes", capture)
    tok = load_tokenizer()
    with pytest.raises(StopIteration):
        evaluate_agent(None, tok, [{"prompt": PROMPT, "answer": "Lima"}], env=env_ref)
    assert len(seen) == 1
    assert_tool_in(seen[0], tok, env_ref)
    function = json.loads(spec_ids(tok, env_ref)[1])
    assert seen[0] == encode_prompt(tok, PROMPT, tools=[{"type": "function", "function": function}])


def test_generate_prompts_carry_the_environments_tools(env_ref, monkeypatch):
    import rollout.cli
    from rewards.envs import make_environment

    seen = []
    monkeypatch.setattr(rollout.cli, "_multiturn", lambda args, model, tok, texts, ids, *a: seen.extend(ids) or 0)
    assert rollout.cli.main(["--model", "preset:tiny", "--chat", "--prompt", PROMPT],
                            env_factory=lambda: make_environment(env_ref)) == 0
    tok = load_tokenizer()
    assert len(seen) == 1
    assert_tool_in(seen[0], tok, env_ref)
    # without --env (single-turn) the chat prompt has no tools
    assert rollout.cli.main(["--model", "preset:tiny", "--chat", "--prompt", PROMPT, "--max-new-tokens", "4"]) == 0

