"""rewards/verifiers_reward.py: a verifiers rubric (third-party code fed policy text) scores in the verifier
sandbox: an answer it evaluates cannot touch the host or change how later answers score."""
import asyncio
import builtins
import os
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="the envs extra (pip install -e '.[envs]'; Python 3.11-3.13)")

from ebpo.infra.data import load_rows  # noqa: E402
from rewards import verifier_sandbox  # noqa: E402
from rewards.verifiers_reward import verifiers_reward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EVAL_ENV = "tests/rewards/data/vf_eval_env.py"


@pytest.fixture(autouse=True)
def repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    verifier_sandbox.close()
    yield
    verifier_sandbox.close()


def score(completion, row, **kw):
    return asyncio.run(verifiers_reward(completion=completion, metadata=row["metadata"], **kw))


def test_an_evaluated_answer_stays_in_the_sandbox(tmp_path):
    rows = load_rows(f"vf:{EVAL_ENV}")
    real_float = builtins.float
    marker = str(tmp_path / "pwned")
    os.chmod(tmp_path, 0o777)  # writable by the sandbox uid too: only the sandbox can stop the write
    attacks = [f"__import__('os').system('echo x > {marker}_system')",
               f"open('{marker}_file', 'w').write('x')",
               "[0 for _ in iter(int, 1)]"]
    for attack in attacks:
        got = score(f"\\boxed{{{attack}}}", rows[0], timeout_s=2.0)
        assert got.score == 0.0, (attack, got)
    # this rubric calls float() after its eval: the answer can rig its own score, never a later one's
    score("\\boxed{setattr(__import__('builtins'), 'float', lambda *a: 1.0)}", rows[0], timeout_s=2.0)
    assert os.listdir(tmp_path) == [] and builtins.float is real_float
    for row in rows:  # later answers score as the rubric says: right 1, wrong 0
        assert score(f"\\boxed{{{row['answer']}}}", row, timeout_s=2.0).score == 1.0
        assert score(f"\\boxed{{{int(row['answer']) + 1}}}", row, timeout_s=2.0).score == 0.0
