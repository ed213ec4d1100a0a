"""Run a program and its test probes in a sandbox; return the trusted harness's records.

Layers, strongest available first (``mode="auto"``):
- ``bwrap``: bubblewrap with a read-only root, private /tmp holding only the work dir, new user/pid/net/
  ipc/uts namespaces, ``--die-with-parent`` and ``--new-session``.
- ``unshare``: util-linux ``unshare --user --net --pid --ipc --uts --fork --kill-child`` (no network,
  private pid space; the file system stays the host's, guarded by the uid below).
- ``rlimits``: resource limits, a process group and the uid below only.
In every mode: a fresh temporary directory as cwd and HOME, a scrubbed environment, rlimits (CPU seconds,
address space, processes, file size, open files, no core files) set by the harness before any candidate
code runs, per-test and whole-run deadlines, and everything killed afterwards. When we run as root the
sandbox runs under a dedicated unprivileged uid (one per concurrent sandbox, held by a lock file), which
is what makes the process limit bite and lets us kill every leftover process of that uid.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

UID_BASE, UID_COUNT = 61000, 512
_LOCK_DIR = os.path.join(tempfile.gettempdir(), "ebpo-sandbox-uids")
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_harness.py")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}


@dataclasses.dataclass
class Limits:
    """Per-sandbox limits. Times in seconds, sizes in bytes (the ``*_mb`` fields in MiB)."""

    test_timeout_s: float = 2.0      # wall clock per test (each test is its own forked process)
    total_timeout_s: float = 20.0    # wall clock for all tests of one program
    memory_mb: int = 1024            # RLIMIT_AS per process
    max_procs: int = 32              # RLIMIT_NPROC (per sandbox uid; bites only under a non-root uid)
    file_size_mb: int = 16           # RLIMIT_FSIZE
    open_files: int = 64             # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # per-test cap on captured stdout / serialised values


@dataclasses.dataclass
class SandboxInfo:
    """What protection is in force (reported in extras and stats)."""

    mode: str                 # bwrap | unshare | rlimits
    network_isolated: bool
    pid_namespace: bool
    readonly_root: bool
    dedicated_uid: bool       # runs under its own unprivileged uid
    python: str               # interpreter used inside the sandbox


class SandboxError(RuntimeError):
    """Infrastructure failure (sandbox did not start, harness output unreadable): score "skip"."""


def _world_executable(path: str) -> bool:
    """True if a stranger uid can reach and execute ``path`` (every directory o+x, file o+x)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        try:
            if not os.stat(os.sep.join(parts[:i])).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def sandbox_python() -> str:
    """Interpreter for the sandbox: ours if a dropped uid can run it, else a system python3."""
    if os.geteuid() != 0:
        return sys.executable
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if cand and os.path.exists(cand) and _world_executable(cand):
            return cand
    return sys.executable  # nothing reachable by a stranger uid: stay root (weaker; see docs)


def _drop_uid() -> bool:
    return os.geteuid() == 0 and _world_executable(sandbox_python())


def _prefix(mode: str, work: str) -> list[str]:
    if mode == "bwrap":
        return ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                "--tmpfs", "/dev/shm", "--bind", work, work, "--chdir", work, "--unshare-all",
                "--die-with-parent", "--new-session", "--"]
    if mode == "unshare":
        return ["unshare", "--user", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--"]
    return []


@functools.lru_cache(maxsize=None)
def mode_works(mode: str) -> bool:
    """Probe once per process whether ``mode`` can start a program here."""
    if mode == "bwrap" and not shutil.which("bwrap"):
        return False
    if mode == "unshare" and not shutil.which("unshare"):
        return False
    try:
        with _Slot() as uid, tempfile.TemporaryDirectory(prefix="ebpo-probe-") as work:
            if uid is not None:
                os.chown(work, uid, uid)
            out = subprocess.run(_prefix(mode, work) + [sandbox_python(), "-I", "-c", "print(6*7)"],
                                 capture_output=True, timeout=20, env=SAFE_ENV, cwd=work,
                                 **_user_kwargs(uid))
        return out.returncode == 0 and out.stdout.strip() == b"42"
    except (OSError, subprocess.SubprocessError):
        return False


def resolve_mode(mode: str = "auto") -> SandboxInfo:
    """Pick the strongest working mode (or check the requested one); raise SandboxError if unusable."""
    order = ["bwrap", "unshare", "rlimits"] if mode == "auto" else [mode]
    if mode not in ("auto", "bwrap", "unshare", "rlimits"):
        raise ValueError(f"sandbox mode must be auto, bwrap, unshare or rlimits; got {mode!r}")
    for m in order:
        if m == "rlimits" or mode_works(m):
            return SandboxInfo(mode=m, network_isolated=m != "rlimits", pid_namespace=m != "rlimits",
                               readonly_root=m == "bwrap", dedicated_uid=_drop_uid(), python=sandbox_python())
    raise SandboxError(f"sandbox mode {mode!r} does not work on this machine")


class _Slot:
    """Holds an exclusive lock on one uid of the dedicated range (root only); yields the uid or None."""

    def __enter__(self):
        self.fd = None
        if not _drop_uid():
            return None
        os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
        start = os.getpid() % UID_COUNT
        for k in range(UID_COUNT):
            uid = UID_BASE + (start + k) % UID_COUNT
            fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.fd, self.uid = fd, uid
            return uid
        raise SandboxError("all sandbox uids are busy")

    def __exit__(self, *exc):
        if self.fd is not None:
            kill_uid(self.uid)  # leftovers of this slot die before the slot is handed on
            os.close(self.fd)


def _user_kwargs(uid):
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def kill_uid(uid: int, rounds: int = 20) -> int:
    """SIGKILL every process whose real uid is ``uid`` until none is left; returns how many were seen."""
    seen = 0
    for _ in range(rounds):
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                            break  # already dead, only waiting to be reaped
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(name))
                            break
            except OSError:
                continue
        if not pids:
            return seen
        seen += len(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    return seen


def run_tests(code: str, tests: list[dict], limits: Limits, info: SandboxInfo) -> list[dict | None]:
    """Run ``code`` against harness ``tests`` (see _harness.py); return one record per test, None where
    the harness did not report (it was killed: the candidate's fault). Raises SandboxError on
    infrastructure failures (sandbox did not start)."""
    cpu = int(limits.test_timeout_s) + 2
    job = {"code": code, "tests": tests, "test_timeout_s": limits.test_timeout_s,
           "total_timeout_s": limits.total_timeout_s, "max_output_bytes": limits.max_output_bytes,
           "kill_all": info.dedicated_uid or info.pid_namespace,
           "limits": {"cpu_s": cpu, "memory_bytes": limits.memory_mb << 20, "max_procs": limits.max_procs,
                      "file_size_bytes": limits.file_size_mb << 20, "open_files": limits.open_files}}
    with _Slot() as uid:
        work = tempfile.mkdtemp(prefix="ebpo-sbx-")
        try:
            shutil.copyfile(_HARNESS, os.path.join(work, "_harness.py"))
            with open(os.path.join(work, "job.json"), "w") as f:
                json.dump(job, f)
            if uid is not None:
                os.chown(work, uid, uid)
            env = dict(SAFE_ENV, HOME=work, TMPDIR=work)
            cmd = _prefix(info.mode, work) + [info.python, "-I", "-B", "_harness.py", "job.json"]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=work, env=env, start_new_session=True,
                                    **_user_kwargs(uid))
            try:
                out, err = proc.communicate(timeout=limits.total_timeout_s + 5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
        finally:
            if uid is not None:
                kill_uid(uid)  # before deleting: nothing of the sandbox may still write there
            shutil.rmtree(work, ignore_errors=True)
    lines = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
    try:
        records = [json.loads(ln) for ln in lines]
    except ValueError as e:
        raise SandboxError(f"harness output unreadable: {e}") from e
    if not records or not records[0].get("ready"):
        raise SandboxError(f"sandbox ({info.mode}) did not start: rc={proc.returncode} "
                           f"stderr={err.decode('utf-8', 'replace')[-300:]!r}")
    by_index: list[dict | None] = [None] * len(tests)
    for rec in records[1:]:
        if isinstance(rec.get("i"), int) and 0 <= rec["i"] < len(tests):
            by_index[rec["i"]] = rec
    return by_index
