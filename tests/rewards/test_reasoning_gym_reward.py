"""rewards/reasoning_gym_reward.py: the answer is found in linear time, and reasoning-gym's verifier (third-party
code fed policy text) runs in the verifier sandbox, never in the reward process."""
import os
import random
import re
import subprocess
import sys
import time

import pytest

from rewards.reasoning_gym_reward import extract_answer

# the regular expressions the scanner replaced (the lazy tag one is quadratic on openers without a closer), as
# the oracle for small texts
OLD_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
OLD_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _old_extract(text):
    for pattern in (OLD_TAG, OLD_BOXED):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    return text.strip()


def test_the_scanner_finds_what_the_regex_found():
    pieces = ["<answer>", "</answer>", "<answer", "answer>", "</", "<", ">", "\\boxed{", "{", "}", " ", "\n",
              "7", "x"]
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 16)))
        assert extract_answer(text) == _old_extract(text), text


NASTY = {  # 1 MiB each (built in the child); the regex needs minutes on the first (74-91 s for 64k characters)
    "unclosed_tags": '"<answer>" * (1 << 17)',
    "unclosed_tags_then_text": '"<answer>" + "x" * (1 << 20)',
    "closers_only": '"</answer>" * (1 << 17)',
    "boxes": '"\\\\boxed{" * (1 << 17)',
    "tag_then_unclosed": '"<answer>42</answer>" + "<answer>" * (1 << 17)',
}


def test_a_megabyte_of_each_nasty_shape_parses_within_a_tight_timeout():
    """All shapes in one child process that must finish within 20 s (the linear scan takes milliseconds; the
    quadratic regex would need hours): a bound on the work, not a timing measurement."""
    code = ("from rewards.reasoning_gym_reward import extract_answer\n"
            f"shapes = [{', '.join(NASTY.values())}]\n"
            "print(repr([extract_answer(t)[:20] for t in shapes]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr[-2000:]
    got = eval(out.stdout)  # noqa: S307 - our own child's repr of a list of str
    assert got == [("<answer>" * 3)[:20], ("<answer>" + "x" * 19)[:20], ("</answer>" * 3)[:20],
                   ("\\boxed{" * 3)[:20], "42"]


# ---------------------------------------------------------------- the verifier runs in the verifier sandbox

MODES = ["auto"] + (["chroot"] if os.geteuid() == 0 else [])  # chroot: the fallback where namespaces are refused


@pytest.fixture(scope="module")
def rg():
    return pytest.importorskip("reasoning_gym", reason="the envs extra (pip install -e '.[envs]')")


@pytest.fixture
def fresh_sandbox():
    from rewards import verifier_sandbox
    verifier_sandbox.close()
    yield
    verifier_sandbox.close()


def _spiral_rows(n=3):
    from ebpo.infra.data import load_rows
    return load_rows(f"rg:spiral_matrix?size={n}&seed=5")  # its verifier eval()s an answer that is not exact


def _attacks(marker):
    """Answers for spiral_matrix, whose verifier `eval`s them with the real builtins (reasoning-gym 0.1.25)."""
    return {
        "os_system": f"[__import__('os').system('echo x > {marker}_system')]",
        "writes_a_file": f"[open('{marker}_file', 'w').write('x')]",
        "rebinds_a_builtin": "[setattr(__import__('builtins'), 'float', lambda *a: 1.0)]",
        "rebinds_the_verifier": ("[setattr(__import__('reasoning_gym.algorithmic.spiral_matrix', fromlist=['x'])"
                                 ".SpiralMatrixDataset, 'score_answer', lambda *a, **k: 1.0)]"),
        "forks_a_daemon": f"[__import__('os').fork() or open('{marker}_daemon', 'w')]",
    }


@pytest.mark.parametrize("mode", MODES)
def test_hostile_answers_score_nothing_change_nothing_and_later_answers_score_right(rg, fresh_sandbox, tmp_path,
                                                                                     monkeypatch, mode):
    """os.system, a file write, rebinding a builtin or the task's own verifier, a fork: each scores 0, leaves
    nothing on the host, and the honest answers scored after them in the same process score as reasoning-gym
    itself scores them (the reference: its score_answer called here directly, on the same entries)."""
    from rewards.reasoning_gym_reward import reasoning_gym_score
    import builtins
    real_float = builtins.float
    rows = _spiral_rows()
    marker = str(tmp_path / "pwned")
    os.chmod(tmp_path, 0o777)  # writable by the sandbox uid too: only the sandbox can stop the write
    reference = rg.get_score_answer_fn("spiral_matrix")
    kw = {"sandbox": mode, "timeout_s": 3.0}
    for name, attack in _attacks(marker).items():
        for row in rows:
            got = reasoning_gym_score(completion=f"<answer>{attack}</answer>", answer=row["answer"],
                                      metadata=row["metadata"], prompt=row["prompt"], **kw)
            assert got.score == 0.0, (name, got)
    assert sorted(os.listdir(tmp_path)) == [], "an answer changed the host"
    assert builtins.float is real_float
    # the verifier is not called in this process: broken here, the reward still scores
    monkeypatch.setattr(rg, "get_score_answer_fn", lambda *_: pytest.fail("score_answer ran in the reward process"))
    for row in rows:
        entry = {"question": row["prompt"], "answer": row["answer"], "metadata": row["metadata"]}
        for pred in (row["answer"], "1 2 3", str(row["answer"].split())):
            want = reference(pred, entry)
            got = reasoning_gym_score(completion=f"<answer>{pred}</answer>", answer=row["answer"],
                                      metadata=row["metadata"], prompt=row["prompt"], **kw)
            assert got.score == want, (pred, got)
    assert {reference(row["answer"], {"answer": row["answer"]}) for row in rows} == {1.0}


@pytest.mark.parametrize("mode", MODES)
def test_an_answer_that_never_ends_costs_its_deadline_and_scores_zero(rg, fresh_sandbox, mode):
    from rewards.reasoning_gym_reward import reasoning_gym_score
    row = _spiral_rows(1)[0]
    reasoning_gym_score(completion="<answer>x</answer>", answer=row["answer"], metadata=row["metadata"],
                        sandbox=mode, timeout_s=1.0)  # the server's start is not part of the bound below
    for attack in ("[9**9**9]", "[0 for _ in iter(int, 1)]", "[bytearray(1 << 40)]"):
        t0 = time.monotonic()
        got = reasoning_gym_score(completion=f"<answer>{attack}</answer>", answer=row["answer"],
                                  metadata=row["metadata"], sandbox=mode, timeout_s=1.0)
        assert got.score == 0.0 and time.monotonic() - t0 < 1.0 + 3.0, (attack, got)
    right = reasoning_gym_score(completion=f"<answer>{row['answer']}</answer>", answer=row["answer"],
                                metadata=row["metadata"], sandbox=mode, timeout_s=1.0)
    assert right.score == 1.0


def test_hostile_answers_in_a_worker_leave_the_worker_scoring_right(rg, tmp_path):
    """Through a RewardWorker with one process: the attacks and then honest answers in the same worker."""
    from rewards import RewardWorker
    rows = _spiral_rows()
    marker = str(tmp_path / "pwned")
    os.chmod(tmp_path, 0o777)
    batch = [{"prompt": r["prompt"], "completion": f"<answer>{a}</answer>", "answer": r["answer"], "tests": None,
              "metadata": r["metadata"]} for a in _attacks(marker).values() for r in rows]
    honest = [dict(b, completion=f"<answer>{rows[k % 3]['answer']}</answer>") for k, b in enumerate(batch[:3])]
    wrong = [dict(b, completion="<answer>1 2</answer>") for b in batch[:3]]
    with RewardWorker(["reasoning_gym"], num_workers=1, timeout_s=60) as w:
        out = w.score(batch + honest + wrong)
    assert [r["score"] for r in out] == [0.0] * len(batch) + [1.0] * 3 + [0.0] * 3
    assert os.listdir(tmp_path) == []


def test_puzzle24_answers_must_use_the_puzzle_s_numbers(rg, fresh_sandbox):
    """puzzle24's own verifier accepts any four in-range numbers that make 24; the reward checks the numbers."""
    from ebpo.infra.data import load_rows
    from rewards.reasoning_gym_reward import LOOPHOLES, reasoning_gym_score
    assert "puzzle24" in LOOPHOLES
    own = rg.get_score_answer_fn("puzzle24")
    for row in load_rows("rg:puzzle24?size=4&seed=1"):
        entry = {"question": row["prompt"], "answer": row["answer"], "metadata": row["metadata"]}
        nums = sorted(row["metadata"]["numbers"])
        cheat = next(c for c in ("6*4*1*1", "8*3*1*1", "2*3*4*1") if sorted(map(int, re.findall(r"\d+", c))) != nums)
        assert own(cheat, entry) == 1.0  # the loophole, in reasoning-gym itself
        got = reasoning_gym_score(completion=f"<answer>{cheat}</answer>", answer=row["answer"],
                                  metadata=row["metadata"], prompt=row["prompt"])
        assert got.score == 0.01 and "loophole" in got.extras
        right = reasoning_gym_score(completion=f"<answer>{row['answer']}</answer>", answer=row["answer"],
                                    metadata=row["metadata"], prompt=row["prompt"])
        assert right.score == 1.0 and "loophole" not in right.extras
