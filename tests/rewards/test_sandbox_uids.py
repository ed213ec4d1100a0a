"""The dedicated sandbox uids (rewards/sandbox_uids.py), used as root: a host process or host user in the uid range
is a start-up error (not a silent zero), and what a killed sandbox left under its uid is swept, not reported."""
import fcntl
import os
import pwd
import subprocess
import time

import pytest

import rewards.sandbox as sandbox
import rewards.sandbox_uids as uids


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
