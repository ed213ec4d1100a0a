"""The dedicated sandbox uids (used when the reward runs as root): slots, the start-up check, the sweep.

Each concurrent sandbox holds one uid of ``UID_BASE .. UID_BASE + UID_COUNT - 1`` through an exclusive
lock file under ``/tmp/ebpo-sandbox-uids``. The file also records whether the last holder cleaned up
(``free``) or not (``busy``: it was killed mid-sample); a dirty uid is swept before it is used again, and
a uid whose leftovers cannot be removed (zombies of a parent that does not reap) is skipped. A clean-up
that does not fit in the sample's budget is finished in the background (sandbox_cleaner), the uid held
and marked busy until it is done: a uid is never handed out with something of its last sample left.

The sweep is ``kill(-1, SIGKILL)`` issued by a helper process running as that uid: the kernel signals
every process of the uid in one pass under the task-list lock, and a process that is forking when the
signal arrives has its fork aborted, so a fork loop cannot slip through (a ``/proc`` scan can miss a
process that changes pid every millisecond).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import pwd
import signal
import tempfile
import time

from rewards import sandbox_cleaner
from rewards.sandbox_leftovers import remove_leftovers

UID_BASE = int(os.environ.get("EBPO_SANDBOX_UID_BASE", "61000"))
UID_COUNT = 512
SANDBOX_UIDS = range(UID_BASE, UID_BASE + UID_COUNT)
ENTER_CLEANUP_S = 1.0  # what a new holder spends on a dead holder's leftovers before taking another uid
LOCK_DIR = os.path.join(tempfile.gettempdir(), "ebpo-sandbox-uids")
_QUARANTINED: set[int] = set()


class UidRangeError(RuntimeError):
    """The dedicated uid range is used by something else on this host."""


def _lock_path(uid: int) -> str:
    return os.path.join(LOCK_DIR, str(uid))


def _read_marker(fd: int) -> bytes:
    return os.pread(fd, 8, 0).strip()


def _write_marker(fd: int, marker: bytes) -> None:
    os.pwrite(fd, marker.ljust(8), 0)


def processes_of(uids: set[int]) -> list[dict]:
    """Processes (zombies included) whose real, effective, saved or fs uid is in ``uids``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        ids = {int(x) for x in fields.get("Uid", "").split()}
        hit = ids & uids
        if hit:
            out.append({"pid": int(name), "uid": min(hit), "state": fields.get("State", "?").split()[0],
                        "ppid": int(fields.get("PPid", "0")), "name": fields.get("Name", "").strip()})
    return out


def sweep_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` at once: a forked helper becomes ``uid`` and calls kill(-1)."""
    pid = os.fork()
    if pid == 0:  # the helper: only system calls, then _exit
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)


def kill_uid(uid: int, wait_s: float = 2.0) -> list[dict]:
    """Sweep ``uid``, reap what we can, and wait until nothing of it runs; returns what is left
    (zombies whose parent does not reap them, or processes stuck in the kernel)."""
    sweep_uid(uid)
    end = time.monotonic() + wait_s
    while True:
        reap_orphans({uid})
        left = processes_of({uid})
        if not left or time.monotonic() >= end or all(p["state"] in "ZX" and p["ppid"] != os.getpid() for p in left):
            return left
        time.sleep(0.005)


def become_subreaper() -> None:
    """Orphans of a sandbox whose harness was killed come to this process (to be reaped here) instead
    of the host's init, which may never reap them (their zombies would count against the uid)."""
    try:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def reap_orphans(uids: set[int]) -> None:
    """Reap zombie children of ours that belong to ``uids`` (orphans re-parented to us)."""
    for p in processes_of(uids):
        if p["ppid"] == os.getpid() and p["state"] == "Z":
            try:
                os.waitpid(p["pid"], os.WNOHANG)
            except ChildProcessError:
                pass


def check_uid_range() -> None:
    """Start-up check: no host user and no foreign process may use the dedicated uid range (the sandbox
    kills every process of its uid and lets the candidate touch that uid's files)."""
    uids = set(range(UID_BASE, UID_BASE + UID_COUNT))
    users = [(u.pw_uid, u.pw_name) for u in pwd.getpwall() if u.pw_uid in uids]
    if users:
        raise UidRangeError(f"sandbox uids {UID_BASE}-{UID_BASE + UID_COUNT - 1} include host users {users[:5]}; "
                            "set EBPO_SANDBOX_UID_BASE to the start of a free range of 512 uids")
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in sorted({p["uid"] for p in processes_of(uids)}):
        fd = os.open(_lock_path(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live sandbox holds this uid: its processes are ours
            left = processes_of({uid})
            if left and _read_marker(fd) == b"busy":  # leftovers of a sandbox whose holder was killed
                left = kill_uid(uid)
            if any(p["state"] in "ZX" for p in left):  # dead but not reaped: would cost the process limit
                _QUARANTINED.add(uid)
            left = [p for p in left if p["state"] not in "ZX"]
            if left:
                raise UidRangeError(
                    f"uid {uid} (sandbox range {UID_BASE}-{UID_BASE + UID_COUNT - 1}) is used by host "
                    f"process(es) {[(p['pid'], p['name']) for p in left[:5]]}; the sandbox would kill them. "
                    "Set EBPO_SANDBOX_UID_BASE to the start of a free range of 512 uids")
        finally:
            os.close(fd)  # closing releases the lock


class Slot:
    """Holds an exclusive lock on one uid of the range; ``with Slot(True) as uid`` (None when ``active`` is
    false). Set ``slot.dirty = True`` when the sandbox did not end cleanly: the uid is swept on exit."""

    def __init__(self, active: bool):
        self.active, self.fd, self.uid, self.dirty = active, None, None, False
        self.unfinished = False  # the clean-up ran out of its budget: finished in the background

    def __enter__(self):
        if not self.active:
            return None
        os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
        start = os.getpid() % UID_COUNT
        for k in range(UID_COUNT):
            uid = UID_BASE + (start + k) % UID_COUNT
            if uid in _QUARANTINED:
                continue
            fd = os.open(_lock_path(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if _read_marker(fd) == b"busy":  # the last holder died mid-sample, or mid-clean-up
                if kill_uid(uid):
                    _QUARANTINED.add(uid)  # unreapable leftovers would cost the next sample its process limit
                    os.close(fd)
                    continue
                # and what it left on the host (files, SysV IPC): a short try, else finished in the
                # background while this process holds the uid, and the next uid is taken
                if not remove_leftovers(uid, time.monotonic() + ENTER_CLEANUP_S, SANDBOX_UIDS)[1]:
                    _finish_later(fd, uid)
                    continue
            _write_marker(fd, b"busy")
            self.fd, self.uid = fd, uid
            return uid
        raise RuntimeError("all sandbox uids are busy")

    def clean(self, deadline: float) -> bool:
        """Remove what the uid left on the host until ``deadline`` (``time.monotonic()`` seconds); when
        that is not enough, the rest is finished in the background on exit, holding the uid meanwhile."""
        if self.fd is None:
            return True
        self.unfinished = not remove_leftovers(self.uid, deadline, SANDBOX_UIDS)[1]
        return not self.unfinished

    def sweep(self) -> None:
        """When the sandbox did not end cleanly: kill everything of the uid now (once), quarantine the uid
        if something cannot be removed."""
        if self.fd is not None and self.dirty:
            if kill_uid(self.uid):
                _QUARANTINED.add(self.uid)
            self.dirty = False

    def __exit__(self, *exc):
        if self.fd is None:
            return
        try:
            self.sweep()
        except Exception:  # the uid stays busy: the next holder sweeps it
            self.unfinished = True
        if self.unfinished:  # marked free (and unlocked) only once nothing of the sample is left
            _finish_later(self.fd, self.uid)
            return
        try:
            _write_marker(self.fd, b"free")
        finally:
            os.close(self.fd)


def _finish_later(fd: int, uid: int) -> None:
    """Hand a uid whose clean-up did not finish to the background cleaner, which holds its lock until
    everything is removed, then marks it free and releases it (given up: released, still marked busy)."""
    def done(finished: bool) -> None:
        try:
            if finished:
                _write_marker(fd, b"free")
        finally:
            os.close(fd)

    sandbox_cleaner.submit(lambda deadline: remove_leftovers(uid, deadline, SANDBOX_UIDS)[1], done)
