"""The reward worker pool (rewards/pool.py): a pool that cannot start names the cause (a script without a
`__main__` guard under the spawn start method) instead of a bare broken-pipe error."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pool_start_failure_names_the_missing_main_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from rewards import RewardWorker
        w = RewardWorker(["format_boxed"], num_workers=1, timeout_s=5)
        w.close()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: reward worker 0 exited with code 1 before it was ready"), out.stderr
    assert f"{script} has no `if __name__ == \"__main__\":` guard" in last
    assert "handle is closed" not in out.stderr
