"""The shipped tiny agent model: it calls the calculator for `Compute a*b.` and guesses for `What is a times
b?` (as its SFT mix teaches), so its greedy success leaves room for RL."""
import json
from pathlib import Path

from ebpo.model.loading import load_model, load_model_tokenizer
from ebpo.sft.agent_eval import evaluate_agent

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_agent_uses_the_tool_for_one_phrasing_only():
    rows = [json.loads(x) for x in (ROOT / "examples/data/agent_eval.jsonl").read_text().splitlines()[:24]]
    model, tok = load_model("tiny-agent").eval(), load_model_tokenizer("tiny-agent")
    res = evaluate_agent(model, tok, rows, env="calculator", keep_samples=len(rows), batch_size=24)
    calls = {p: [len(s["turns"][0]["tool_calls"]) > 0 for s in res.samples if s["prompt"].startswith(p)]
             for p in ("Compute", "What is")}
    solved = {p: [s["solved"] for s in res.samples if s["prompt"].startswith(p)] for p in ("Compute", "What is")}
    assert sum(calls["Compute"]) >= 9 and sum(calls["What is"]) <= 3, calls
    assert sum(solved["Compute"]) >= 7 and sum(solved["What is"]) <= 3, solved
    assert 0.2 <= res.success <= 0.6
