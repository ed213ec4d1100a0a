"""Helpers for the hostile-candidate tests: run one sample and check that nothing of it outlives it.

Independent of the sandbox's own bookkeeping, and looking only at what this test process started (the
machine is shared: another job's sandboxes are none of our business): processes are this process's
descendants in the sandbox uid range (a uid counts only when no sample of ours holds its lock right now)
and processes with the sample's marker in their command line; files by the marker under the host's
temporary directories; sockets by the marker's port in the host's /proc/net/tcp; SysV IPC objects by
the sample's key.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import fcntl
import glob
import os
import shutil
import socket
import textwrap
import time
import uuid

from rewards.code_reward import code_reward
from rewards.sandbox import RUN_GRACE_S, mode_works
from rewards.sandbox_uids import LOCK_DIR, UID_BASE, UID_COUNT

TRACES = '''
import os, sys, time
def _leave_ipc(key):
    """A SysV shared memory segment (1 MiB), a message queue and a semaphore set, by key."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.shmget(key, 1 << 20, 0o1666)  # IPC_CREAT | 0666
    libc.msgget(key + 1, 0o1666)
    libc.semget(key + 2, 1, 0o1666)
def _leave_traces(marker, port, key, nested):
    """Files in every temporary directory (a nested world-writable one too), SysV IPC objects,
    orphaned zombies, and a daemon listening on a port."""
    try:
        _leave_ipc(key)
    except Exception:
        pass
    for d in ("/tmp", "/dev/shm", "/var/tmp", ".", nested):
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


# a HumanEval-style program test (test_program_tests.py, test_code_tests.py): three asserts that call the
# candidate and one that does not
HUMANEVAL = textwrap.dedent('''
    METADATA = {"author": "jt", "dataset": "test"}
    LIMIT = 0.5


    def check(candidate):
        assert candidate([1.0, 2.0, 3.0], LIMIT) == False
        assert candidate([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) == True
        assert True, "This prints if this assert fails (good for debugging!)"
        assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True

    check(has_close_elements)
''')


@dataclasses.dataclass
class Sample:
    marker: str
    port: int
    key: int  # SysV IPC keys key, key + 1, key + 2
    nested: str  # a world-writable directory without the sticky bit, nested under /tmp (like Ray's)
    before: set = dataclasses.field(default_factory=lambda: {p for p, _, _ in _uid_processes()})

    def traces(self) -> str:
        """Candidate code that leaves traces of every kind when it is imported."""
        return TRACES + f"_leave_traces({self.marker!r}, {self.port}, {self.key}, {self.nested!r})\n"


def new_sample() -> Sample:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker = "ebpo-hostile-" + uuid.uuid4().hex[:12]
    nested = f"/tmp/{marker}-session/sockets"
    os.makedirs(nested)
    os.chmod(os.path.dirname(nested), 0o755)
    os.chmod(nested, 0o777)  # world-writable, no sticky bit
    return Sample(marker, port, 0x3B000000 + int(uuid.uuid4().hex[:6], 16) * 4, nested)


def ipc_left(key: int) -> list[str]:
    """SysV IPC objects of the host's namespace with one of the sample's keys."""
    left = []
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        left += [f"{kind}:{r.split()[0]}" for r in rows if int(r.split()[0]) in (key, key + 1, key + 2)]
    return left


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (orphans of our sandboxes come back to us: we are a subreaper)."""
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{cur}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{cur}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _uid_processes() -> list[tuple[int, int, str]]:
    """Our descendants that run under a sandbox uid: (pid, uid, state)."""
    out = []
    for p in map(str, descendants(os.getpid())):
        try:
            with open(f"/proc/{p}/status") as f:
                text = f.read()
        except OSError:
            continue
        uids = {int(x) for x in text.split("Uid:")[1].split("\n")[0].split()} if "Uid:" in text else set()
        hit = [u for u in uids if UID_BASE <= u < UID_BASE + UID_COUNT]
        if hit:
            out.append((int(p), hit[0], text.split("State:")[1].split()[0]))
    return out


def leftover_processes(before: set) -> list[tuple[int, int, str]]:
    """Our descendants (zombies included) under sandbox uids that no sample of ours holds at the moment,
    other than ``before`` (pids seen before the sample)."""
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
    pats = [f"/tmp/*{marker}", f"/dev/shm/*{marker}*", f"/var/tmp/*{marker}*", f"/tmp/*/*{marker}*",
            f"/tmp/{marker}-session/*/*"]
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
                 "files": marked_files(sample.marker), "listening": listening(sample.port),
                 "ipc": ipc_left(sample.key)}
        if not any(state.values()) or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not any(state.values()), state
    shutil.rmtree(f"/tmp/{sample.marker}-session", ignore_errors=True)  # ours, made by new_sample


def run(sample: Sample, code: str, tests, mode: str, max_s: float, **kw):
    """One sample: returns the RewardResult after checking the wall time and that nothing is left."""
    t0 = time.monotonic()
    out = code_reward(completion=code, tests=tests, sandbox=mode, **kw)
    seconds = time.monotonic() - t0
    assert seconds < max_s, (seconds, max_s, out)
    assert_nothing_left(sample)
    return out


MODES = [m for m in ("bwrap", "unshare", "rlimits") if mode_works(m)]
FAST = dict(test_timeout_s=1.0, total_timeout_s=4.0)
BOUND = FAST["total_timeout_s"] + RUN_GRACE_S  # the parent kills the sandbox by then, whatever it does


def run_cases(cases, mode):
    """Run (name, code, tests, kwargs, max_s, check) cases four at a time, each a sample of its own that
    leaves traces of every kind (Sample.traces); each checks its own result."""
    def one(case):
        name, code, tests, kw, max_s, check = case
        sample = new_sample()
        out = run(sample, sample.traces() + code, tests, mode, max_s, **{**FAST, **kw})
        check(out)
        return name

    with cf.ThreadPoolExecutor(max_workers=4) as ex:
        return list(ex.map(one, cases))
