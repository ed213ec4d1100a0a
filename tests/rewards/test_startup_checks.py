"""Start-up errors instead of silent zeros: the sandbox interpreter, the uid range, the timeout budget,
and a reward pool that cannot start."""
import fcntl
import os
import pwd
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import rewards.sandbox as sandbox
import rewards.sandbox_fs as sandbox_fs
import rewards.sandbox_uids as uids
from rewards import RewardWorker, check_timeout_budget
from rewards.code_reward import total_budget_s

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _clear_probe_caches():
    for fn in (sandbox._interpreter, sandbox.mode_works, sandbox_fs.interpreter_info, sandbox.uid_range_checked):
        fn.cache_clear()


@pytest.fixture
def fresh_probes():
    """Each test probes the sandbox anew, and later tests probe the real interpreter again."""
    _clear_probe_caches()
    yield
    _clear_probe_caches()


def _fake_python(version: list, d: str) -> str:
    """A world-executable script in ``d`` that answers the interpreter probe like a Python of ``version``."""
    os.chmod(d, 0o755)
    path = os.path.join(d, "python3")
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho '{\"version\": %s, \"implementation\": \"cpython\", \"executable\": \"%s\", "
                "\"stdlib\": \"/nonexistent\", \"platstdlib\": \"/nonexistent\", \"site\": [], \"sys_path\": [], "
                "\"maps\": []}'\n" % (version, path))
    os.chmod(path, 0o755)
    return path


def test_an_old_or_missing_sandbox_python_is_a_startup_error(monkeypatch, fresh_probes):
    d = tempfile.TemporaryDirectory(prefix="ebpo-fake-python-", dir="/tmp")  # reachable by the sandbox uid
    old = _fake_python([3, 6, 9], d.name)
    monkeypatch.setattr(sandbox, "sandbox_python", lambda: old)
    with pytest.raises(sandbox.SandboxError, match=r"is cpython 3\.6\.9; .* needs CPython >= 3\.9"):
        sandbox.resolve_mode("auto")
    with pytest.raises(sandbox.SandboxError, match="3.6.9"):
        RewardWorker([("code", 1.0, {})], num_workers=0)  # at construction, not as a 0 per sample
    monkeypatch.setattr(sandbox, "sandbox_python", lambda: "/nonexistent/python3")
    sandbox._interpreter.cache_clear()
    with pytest.raises(sandbox.SandboxError, match="does not run here"):
        sandbox.resolve_mode("rlimits")
    d.cleanup()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the dedicated uid range is used only as root")


def _free_marker(uid: int, marker: bytes) -> None:
    os.makedirs(uids.LOCK_DIR, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(uids.LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, marker.ljust(8), 0)
    finally:
        os.close(fd)


@needs_root
def test_a_host_process_in_the_uid_range_is_a_startup_error(fresh_probes):
    uid = uids.UID_BASE + uids.UID_COUNT - 1
    _free_marker(uid, b"free")
    foreign = subprocess.Popen(["sleep", "30"], user=uid, group=uid, extra_groups=[])
    try:
        time.sleep(0.05)
        with pytest.raises(uids.UidRangeError, match=rf"uid {uid} .* host process\(es\) \[\({foreign.pid}, 'sleep'\)"):
            uids.check_uid_range()
        with pytest.raises(sandbox.SandboxError, match="EBPO_SANDBOX_UID_BASE"):
            sandbox.resolve_mode("auto")
        assert foreign.poll() is None  # reported, not killed
    finally:
        foreign.kill()
        foreign.wait()


def _state(pid: int):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().split("State:")[1].split()[0]
    except OSError:
        return None


@needs_root
def test_leftovers_of_a_killed_sandbox_are_swept_not_reported():
    uid = uids.UID_BASE + uids.UID_COUNT - 2
    _free_marker(uid, b"busy")  # the holder died mid-sample
    uids.become_subreaper()  # as run_tests does in rlimits mode: the orphan's zombie comes back to us
    # an orphan, as a sandbox's leftover would be (not a child of ours)
    sh = subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], user=uid, group=uid, extra_groups=[],
                        capture_output=True, text=True, check=True)
    pid = int(sh.stdout)
    try:
        assert _state(pid) in ("S", "R")
        uids.check_uid_range()
        assert _state(pid) is None  # killed and reaped
    finally:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
        _free_marker(uid, b"free")


@needs_root
def test_a_host_user_in_the_uid_range_is_a_startup_error(monkeypatch):
    fake = pwd.struct_passwd(("alice", "x", uids.UID_BASE + 7, 100, "", "/home/alice", "/bin/sh"))
    monkeypatch.setattr(uids.pwd, "getpwall", lambda: [fake])
    with pytest.raises(uids.UidRangeError, match="host users.*alice"):
        uids.check_uid_range()


def test_timeout_budget_check_names_both_keys():
    assert total_budget_s({}) == 20 + sandbox.RUN_GRACE_S + sandbox.CLEANUP_S
    assert total_budget_s({"total_timeout_s": 5, "sandbox": "bwrap"}) == 5 + sandbox.RUN_GRACE_S + sandbox.CLEANUP_S
    with pytest.raises(ValueError, match=r"reward\.timeout_s \(10 s\).*reward\.fns\[0\]\.kwargs\.total_timeout_s \(20 s\)"):
        check_timeout_budget([("code", 1.0, {})], 10)
    specs = [("math", 1.0, {}), {"ref": "code", "kwargs": {"total_timeout_s": 30}}]
    with pytest.raises(ValueError, match=r"reward\.fns\[1\]\.kwargs\.total_timeout_s \(30 s\)"):
        check_timeout_budget(specs, 30)
    check_timeout_budget(specs, 40)  # long enough
    check_timeout_budget([("math", 1.0, {})], 1)  # no code reward: nothing to check
    with pytest.warns(UserWarning, match="RewardWorker timeout_s"):
        RewardWorker([("code", 1.0, {"total_timeout_s": 4})], num_workers=1, timeout_s=5).close()


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
