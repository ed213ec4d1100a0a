"""Helpers for the hostile-candidate tests: run one sample and check that nothing of it outlives it.

Independent of the sandbox's own bookkeeping: processes are found by scanning /proc for the sandbox uid
range (a uid counts only when no sandbox holds its lock: concurrent samples hold theirs) and for the
sample's marker in a command line; files by the marker under the host's temporary directories; sockets
by the marker's port in the host's /proc/net/tcp.
"""
from __future__ import annotations

import dataclasses
import fcntl
import glob
import os
import socket
import time
import uuid

from rewards.code_reward import code_reward
from rewards.sandbox_uids import LOCK_DIR, UID_BASE, UID_COUNT

TRACES = '''
import os, sys, time
def _leave_traces(marker, port):
    """Files in every temporary directory, orphaned zombies, and a daemon listening on a port."""
    for d in ("/tmp", "/dev/shm", "/var/tmp", "."):
        try:
            with open(os.path.join(d, marker), "wb") as f:
                f.write(b"x" * 65536)
        except OSError:
            pass
    for _ in range(3):
        try:
            if os.fork() == 0:
                try:
                    if os.fork() == 0:
                        os._exit(0)
                finally:
                    os._exit(0)
        except OSError:
            pass
    try:
        if os.fork() == 0:
            try:
                os.setsid()
                if os.fork() == 0:
                    code = ("import socket, time\\ns = socket.socket()\\ntry:\\n    s.bind(('127.0.0.1', %d))\\n"
                            "    s.listen()\\nexcept OSError:\\n    pass\\ntime.sleep(60)" % port)
                    os.execv(sys.executable, [sys.executable, "-c", code, marker])
            finally:
                os._exit(0)
    except OSError:
        pass
'''


@dataclasses.dataclass
class Sample:
    marker: str
    port: int
    before: set = dataclasses.field(default_factory=lambda: {p for p, _, _ in _uid_processes()})

    def traces(self) -> str:
        """Candidate code that leaves traces of every kind when it is imported."""
        return TRACES + f"_leave_traces({self.marker!r}, {self.port})\n"


def new_sample() -> Sample:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Sample("ebpo-hostile-" + uuid.uuid4().hex[:12], port)


def _uid_processes() -> list[tuple[int, int, str]]:
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/status") as f:
                text = f.read()
        except OSError:
            continue
        uids = {int(x) for x in text.split("Uid:")[1].split("\n")[0].split()}
        hit = [u for u in uids if UID_BASE <= u < UID_BASE + UID_COUNT]
        if hit:
            out.append((int(p), hit[0], text.split("State:")[1].split()[0]))
    return out


def leftover_processes(before: set) -> list[tuple[int, int, str]]:
    """Processes (zombies included) of sandbox uids that no sandbox holds at the moment, other than
    ``before`` (pids seen before the sample: another run's unreapable zombies are not ours)."""
    left = []
    for uid in sorted({u for _, u, _ in _uid_processes()}):
        fd = os.open(os.path.join(LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a sample running right now holds this uid
        try:
            left += [p for p in _uid_processes() if p[1] == uid and p[0] not in before]
        finally:
            os.close(fd)
    return left


def marked_processes(marker: str) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(p))
            except OSError:
                pass
    return pids


def marked_files(marker: str) -> list[str]:
    pats = [f"/tmp/*{marker}*", f"/dev/shm/*{marker}*", f"/var/tmp/*{marker}*", f"/tmp/*/*{marker}*"]
    return [p for pat in pats for p in glob.glob(pat)]


def listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                return True
    return False


def assert_nothing_left(sample: Sample) -> None:
    """No process, file or socket of the sample outlives it (allowing the kernel a moment to tear down)."""
    end = time.monotonic() + 1.0
    while True:
        state = {"processes": leftover_processes(sample.before), "marked": marked_processes(sample.marker),
                 "files": marked_files(sample.marker), "listening": listening(sample.port)}
        if not any(state.values()) or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not any(state.values()), state


def run(sample: Sample, code: str, tests, mode: str, max_s: float, **kw):
    """One sample: returns the RewardResult after checking the wall time and that nothing is left."""
    t0 = time.monotonic()
    out = code_reward(completion=code, tests=tests, sandbox=mode, **kw)
    seconds = time.monotonic() - t0
    assert seconds < max_s, (seconds, max_s, out)
    assert_nothing_left(sample)
    return out
