"""`ebpo generate --env ... --show` renders turns, tool calls and results; `ebpo eval --env` reports success."""
import json

from rich.console import Console

from rollout.show import render_trajectory


class CallingEnv:
    """Pretends the model called `calc` on every turn; done after two turns."""

    def __init__(self):
        self.k = 0

    def reset(self, row, seed=None):
        return None

    def step(self, text):
        self.k += 1
        call = {"name": "calc", "arguments": {"expr": "2*3"}, "ok": self.k == 1, "latency_s": 0.01,
                "result": "6" if self.k == 1 else "error: boom"}
        return ("6", 1.0 if self.k == 2 else 0.0, self.k >= 2, {"tool_calls": [call]})


def test_generate_env_show_renders_turns_calls_and_results(capsys):
    from rollout.cli import main

    assert main(["--model", "tiny-sft", "--chat", "--prompt", "Compute 4+4.", "--max-new-tokens", "16", "--show"],
                env_factory=CallingEnv, multiturn={"max_turn_tokens": 16}) == 0
    out = capsys.readouterr().out
    assert "stop: done" in out and "turns 2" in out and "tool calls 2" in out
    assert "[turn 1," in out and "[turn 2," in out and "calc({'expr': '2*3'}) = 6" in out and "error: boom" in out


def test_render_shows_failures():
    from ebpo.model.tokenizer import load_tokenizer

    traj = {"stop": "env_timeout", "failed": True, "error": "env.step timed out", "env_reward": 0.0,
            "prompt_ids": [40, 41], "turns": [{"index": 0, "forwards": 3, "finished_by": "tool_call",
                                                 "text": '<tool_call>{"name": "x"}</tool_call>', "tool_calls": [],
                                                 "error": "env.step timed out", "observation": None}]}
    console = Console(record=True, width=200)
    console.print(render_trajectory(traj, load_tokenizer()))
    text = console.export_text()
    assert "FAILED" in text and "environment failed: env.step timed out" in text and '<tool_call>{"name": "x"}' in text


def test_eval_env_reports_success(tmp_path):
    from ebpo.cli.eval import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Compute {a}*{b}.", "answer": str(a * b)}) + "\n"
                            for a, b in [(482, 37), (101, 11)]))
    out = tmp_path / "res.json"
    assert main(["--model", "tiny-sft", "--data", str(rows), "--env", "calculator", "--json", str(out),
                 "--multiturn", '{"max_turn_tokens": 24}']) == 0
    res = json.loads(out.read_text())
    assert res["rows"] == 2 and 0.0 <= res["success"] <= 1.0 and "agent/turns" in res["metrics"]
