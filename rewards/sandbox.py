"""Run a program in a sandbox against tests run by the judge; return the judge's verdicts.

The candidate runs in the sandbox (one process per test, started by the trusted harness); the test code
runs outside it, in the judge's confined test runners (``rewards/judge.py``, ``_judge_runner.py``: a
sandbox uid of their own, ``rewards/_jail.py``), and calls the candidate through a channel that carries
plain data only. This module starts both for one sample, supervises them, and enforces the deadlines
from outside: the verdicts come from the judge's writer, once per test and in order, the harness's
records only tell the parent which test is running.

Modes, strongest available first (``mode="auto"``):
- ``bwrap``: bubblewrap; a new root holding only the interpreter, its standard library, its shared
  objects and the allowed site-packages (read-only), fresh size-limited tmpfs on /tmp (the work dir),
  /dev/shm and /var/tmp, new user/pid/net/ipc/uts namespaces, the harness as pid 1.
- ``unshare``: util-linux ``unshare`` with new user/mount/pid/net/ipc/uts namespaces and its own /proc;
  the harness (pid 1) mounts private tmpfs on /tmp, /dev/shm, /var/tmp and drops every capability. The
  rest of the host file system is visible with the sandbox uid's permissions.
- ``rlimits``: resource limits, process groups and the sandbox uid only; a host work dir as cwd/TMPDIR.
In every mode: a scrubbed environment, ``python -I``, rlimits set in each test process before candidate
code runs, per-test and whole-run deadlines enforced by the harness *and* from here (the parent), and
every process killed after the sample. When we run as root the sandbox runs under a dedicated
unprivileged uid (see sandbox_uids). What each mode does not protect is listed in docs/rewards.md.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings

from rewards import judge as judge_proc
from rewards import sandbox_cleaner, sandbox_uids
from rewards.sandbox_leftovers import unsticky_dirs
from rewards.sandbox_rmtree import remove_path
from rewards.sandbox_fs import InterpreterError, InterpreterInfo, bwrap_binds, interpreter_info
from rewards.sandbox_uids import UID_BASE, UID_COUNT, Slot, kill_uid  # noqa: F401 (re-exported)

_LOG = logging.getLogger("rewards.sandbox")
# the harness's source: the plain-data format first (shared with the judge), then the harness itself
_HARNESS_SRC = judge_proc._source("_plain.py") + b"\n" + judge_proc._source("_harness.py")
# The harness arrives on stdin, compiled (a marshalled code object, length-prefixed, then the job line):
# nothing of the host file system needs to be visible for it, the sandbox's command line stays short, and
# a sandbox start unmarshals ~700 lines instead of compiling them (100 times cheaper).
_BOOT = ("import marshal, os\n"
         "def r(n):\n"
         "    b = b''\n"
         "    while len(b) < n:\n"
         "        c = os.read(0, n - len(b))\n"
         "        if not c:\n"
         "            raise SystemExit('harness: truncated input')\n"
         "        b += c\n"
         "    return b\n"
         "exec(marshal.loads(r(int(r(10)))), {'__name__': '__main__'})\n")
_COMPILE = ("import marshal, sys\n"
            "sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.buffer.read(), '<ebpo-harness>', 'exec')))\n")
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
TEST_GRACE_S = 2.0   # the parent kills the sandbox when a test runs this much past its deadline
RUN_GRACE_S = 3.0    # ... and when the whole run (start-up included) runs this much past total_timeout_s
CLEANUP_S = 2.0      # at most this long to kill and collect a sandbox that did not end by itself
CLEANUP_MARGIN_S = 0.1  # rlimits: the removal of leftovers stops this long before the call's wall bound


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
    tmp_mb: int = 64                 # size of each private tmpfs (/tmp = work dir, /dev/shm, /var/tmp)
    site_packages: tuple = ()        # extra directories visible and importable inside (default: none)


@dataclasses.dataclass
class SandboxInfo:
    """What protection is in force (reported in extras and stats)."""

    mode: str                 # bwrap | unshare | rlimits
    network_isolated: bool
    pid_namespace: bool
    readonly_root: bool       # only the interpreter, its libraries and the work dir are visible (bwrap)
    dedicated_uid: bool       # runs under its own unprivileged uid
    python: str               # interpreter used inside the sandbox
    private_tmp: bool = False     # /tmp, /dev/shm, /var/tmp are private tmpfs removed with the sandbox
    python_version: tuple = ()


class SandboxError(RuntimeError):
    """Infrastructure failure (sandbox did not start, unusable interpreter or uid range): score "skip",
    or a start-up error when raised by ``resolve_mode``."""


@functools.lru_cache(maxsize=None)
def harness_code(python: str) -> bytes:
    """The harness compiled by the sandbox's own interpreter (the marshal format is that interpreter's),
    once per process. Our own source, compiled outside any sandbox: nothing of a candidate is involved."""
    try:
        out = subprocess.run([python, "-I", "-B", "-c", _COMPILE], input=_HARNESS_SRC, capture_output=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, cwd="/")
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"the sandbox interpreter {python!r} cannot compile the harness: {e}") from None
    if out.returncode or not out.stdout:
        raise SandboxError(f"the sandbox interpreter {python!r} cannot compile the harness: "
                           f"{out.stderr.decode('utf-8', 'replace')[-300:]}")
    return out.stdout


def wall_bound_s(limits: Limits) -> float:
    """Longest a ``run_tests`` call can take: the parent kills the sandbox by then, whatever it does."""
    return limits.total_timeout_s + RUN_GRACE_S + CLEANUP_S


# ---- interpreter and uid -----------------------------------------------------------------------------

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


def _user_kwargs(uid):
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


@functools.lru_cache(maxsize=None)
def _interpreter() -> InterpreterInfo:
    """The sandbox interpreter's version and files, checked once per process (a start-up error if it
    cannot run the harness)."""
    try:
        with Slot(_drop_uid()) as uid:
            info = interpreter_info(sandbox_python(), uid)
    except InterpreterError as e:
        raise SandboxError(str(e)) from None
    if info.version[:2] != sys.version_info[:2]:
        _LOG.warning("code reward: the sandbox runs Python %s (%s) while this process runs %s; completions "
                     "that need the newer language or library fail there", ".".join(map(str, info.version)),
                     info.path, ".".join(map(str, sys.version_info[:3])))
    return info


@functools.lru_cache(maxsize=None)
def uid_range_checked() -> bool:
    try:
        sandbox_uids.check_uid_range()
    except sandbox_uids.UidRangeError as e:
        raise SandboxError(str(e)) from None
    return True


# ---- modes -------------------------------------------------------------------------------------------

_PROBE_ERRORS: dict[str, str] = {}


def _info_for(mode: str) -> SandboxInfo:
    interp = _interpreter()
    return SandboxInfo(mode=mode, network_isolated=mode != "rlimits", pid_namespace=mode != "rlimits",
                       readonly_root=mode == "bwrap", dedicated_uid=_drop_uid(), python=interp.path,
                       private_tmp=mode != "rlimits", python_version=interp.version)


@functools.lru_cache(maxsize=None)
def mode_works(mode: str) -> bool:
    """Probe once per process whether ``mode`` can run the real harness here (one probe test)."""
    tool = {"bwrap": "bwrap", "unshare": "unshare"}.get(mode)
    if tool and not shutil.which(tool):
        _PROBE_ERRORS[mode] = f"{tool} is not installed"
        return False
    try:
        verdicts = run_tests("def x():\n    return 6", [{"kind": "call", "src": "assert x() * 7 == 42", "names": ["x"]}],
                             Limits(test_timeout_s=10, total_timeout_s=20), _info_for(mode))
        ok = verdicts == [(True, "ok")]
        if not ok:
            _PROBE_ERRORS[mode] = f"probe test gave {verdicts!r}"[:300]
    except (SandboxError, OSError, ValueError) as e:
        _PROBE_ERRORS[mode] = f"{type(e).__name__}: {e}"[:300]
        ok = False
    if not ok and tool:
        _LOG.warning("code reward: sandbox mode %s does not work here: %s", mode, _PROBE_ERRORS[mode])
    return ok


@functools.lru_cache(maxsize=None)
def _warn_rlimits_picked() -> None:
    """Once per process: ``auto`` fell back to the weakest mode; say what it leaves open."""
    found = unsticky_dirs()
    msg = ("code reward: sandbox mode 'auto' picked 'rlimits' (bwrap and unshare do not work here: "
           + "; ".join(f"{m}: {e}" for m, e in _PROBE_ERRORS.items()) + "). It does not isolate the network, "
           "the host's unix sockets (connect() needs only write permission on a socket file, e.g. under /run "
           "or /tmp) or the host file system: in a world-writable directory without the sticky bit (Ray's "
           "/tmp/ray/session_* directories" + (f"; here: {', '.join(found)}" if found else "") + ") a "
           "candidate can delete or rename other users' files, the trainer's own Ray session included. "
           "Install bubblewrap (bwrap), or allow unprivileged user namespaces (unshare), to stop that; "
           "see docs/rewards.md")
    _LOG.warning(msg)
    warnings.warn(msg, stacklevel=3)


def resolve_mode(mode: str = "auto") -> SandboxInfo:
    """Pick the strongest working mode (or check the requested one). Raises SandboxError at start-up when
    the mode is unusable, the sandbox interpreter cannot run the harness, or the uid range is taken."""
    if mode not in ("auto", "bwrap", "unshare", "rlimits"):
        raise ValueError(f"sandbox mode must be auto, bwrap, unshare or rlimits; got {mode!r}")
    if _drop_uid():
        uid_range_checked()
    _interpreter()
    for m in (["bwrap", "unshare", "rlimits"] if mode == "auto" else [mode]):
        if mode_works(m):
            if mode == "auto" and m == "rlimits":
                _warn_rlimits_picked()
            return _info_for(m)
    raise SandboxError(f"sandbox mode {mode!r} does not work on this machine: "
                       + "; ".join(f"{m}: {e}" for m, e in _PROBE_ERRORS.items()))


def _command(info: SandboxInfo, limits: Limits) -> list[str]:
    interp = _interpreter()
    python = info.python  # the interpreter whose version and files were checked (tests may swap it)
    tail = ["-I", "-B", "-c", _BOOT]
    if info.mode == "bwrap":
        tmp = str(limits.tmp_mb << 20)
        return ["bwrap", *bwrap_binds(interp, tuple(limits.site_packages)), "--dev", "/dev", "--proc", "/proc",
                "--size", tmp, "--tmpfs", "/tmp", "--size", tmp, "--tmpfs", "/dev/shm",
                "--symlink", "/tmp", "/var/tmp", "--remount-ro", "/", "--chdir", "/tmp",
                "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--", os.path.realpath(python), *tail]
    if info.mode == "unshare":
        return ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--net", "--ipc", "--uts", "--", python, *tail]
    return [python, *tail]


# ---- one sandboxed run ---------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo and len(out) < 10000:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _wait(readers, writer, timeout_s: float) -> tuple[list, bool]:
    """poll(2) for the readable ``readers`` and a writable ``writer`` (or None), up to ``timeout_s``
    seconds. Not select(2): a reward process with more than 1024 descriptors open (a trainer) gets
    descriptor numbers select cannot take."""
    p = select.poll()
    for fd in readers:
        p.register(fd, select.POLLIN)
    if writer is not None:
        p.register(writer, select.POLLOUT)
    readable, writable = [], False
    for fd, ev in p.poll(max(0.0, timeout_s) * 1000.0):
        if fd == writer and ev & (select.POLLOUT | select.POLLERR | select.POLLHUP):
            writable = True
        if fd in readers and ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            readable.append(fd)
    return readable, writable


class _Session:
    """Feeds the job to the harness, reads its progress and the judge's verdicts, and enforces the
    deadlines from outside (judging included: the judge's time counts against the same budget)."""

    def __init__(self, proc: subprocess.Popen, job: bytes, limits: Limits, n_tests: int, verdicts,
                 max_capture: int = 0):
        self.proc, self.pending, self.limits, self.vsock = proc, job, limits, verdicts
        self.verdicts: list = [None] * n_tests
        self.outputs: list = [""] * n_tests  # captured stdout of `capture` tests (text, bounded by the judge)
        self.records: list = [None] * n_tests
        self.ready, self.done, self.judged, self.current, self.reason = None, False, False, None, ""
        self.judge_pidfd, self.v_closed, self.vbuf = None, False, bytearray()
        self.got_pid, self.next_verdict, self.infra_error = False, 0, None
        self.stderr = bytearray()
        self.hard_end = time.monotonic() + limits.total_timeout_s + RUN_GRACE_S
        self.test_end = None
        self.line_cap = 1 << 16
        # a verdict carries a capture test's text (at most max_capture characters) as escaped JSON: up to 12
        # bytes a character (a 4-byte one is a surrogate pair of \\uXXXX)
        self.verdict_cap = max(1 << 16, 12 * max_capture + 4096)

    def _handle(self, line: bytes) -> None:
        """One line of the harness's stdout (trusted code, but in a process the candidate may stop)."""
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        now = time.monotonic()
        if obj.get("ready"):
            self.ready = obj
            self.test_end = now + TEST_GRACE_S
        elif isinstance(obj.get("start"), int):
            self.current = obj["start"]
            self.test_end = now + self.limits.test_timeout_s + TEST_GRACE_S
        elif isinstance(obj.get("i"), int) and 0 <= obj["i"] < len(self.records):
            self.records[obj["i"]] = obj
            self.current, self.test_end = None, now + TEST_GRACE_S
        elif obj.get("done"):
            self.done, self.test_end = True, None

    def _verdict(self, line: bytes) -> None:
        """One line from the judge's writer for this sample, the only process holding this socket (test code
        runs in runners that cannot reach it). Accepted in the protocol's order only: its pid first, then
        exactly one verdict per test, test 0 first, then ``done`` once every test has one; a line out of
        that order, or one the protocol does not have, is ignored."""
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # a judge killed mid-line
            return
        if not isinstance(obj, dict):
            return
        if self.judge_pidfd is None and not self.got_pid:
            if type(obj.get("pid")) is int:
                self.got_pid = True
                try:
                    self.judge_pidfd = os.pidfd_open(obj["pid"])
                except OSError:
                    pass
            return
        if type(obj.get("error")) is str:  # a runner could not be started or confined: not the candidate's
            self.infra_error = obj["error"][:300]
            self.judged = True
        elif obj.get("i") == self.next_verdict and self.next_verdict < len(self.verdicts) \
                and type(obj.get("ok")) is bool and type(obj.get("why")) is str:
            self.verdicts[self.next_verdict] = (obj["ok"], obj["why"][:60])
            if type(obj.get("out")) is str:
                self.outputs[self.next_verdict] = obj["out"]
            self.next_verdict += 1
            self.test_end = time.monotonic() + TEST_GRACE_S
        elif obj.get("done") == 1 and self.next_verdict == len(self.verdicts):
            self.judged = True

    def run(self) -> None:
        out_fd, err_fd, in_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno(), self.proc.stdin.fileno()
        v_fd = self.vsock.fileno()
        os.set_blocking(in_fd, False)
        bufs, open_fds = {out_fd: bytearray(), v_fd: self.vbuf}, {out_fd, err_fd}
        if self.verdict_cap > 1 << 16:  # a capture's verdict may not fit the socket's buffer: read as it comes
            open_fds.add(v_fd)
        while True:
            if (self.done or out_fd not in open_fds) and v_fd not in open_fds and not self.v_closed:
                # the verdicts wait in their socket until the harness is done (the judge says bye
                # first): one wake-up for all of them, not one per test
                open_fds.add(v_fd)
                self.test_end = None
            if self.judged or self.v_closed or not open_fds or (out_fd not in open_fds and not self.ready):
                break  # judged, or everything closed, or the sandbox did not start
            now = time.monotonic()
            end = min(self.hard_end, self.test_end or self.hard_end)
            if now >= end:
                self.reason = "deadline"
                return
            readable, writable = _wait(open_fds, in_fd if self.pending else None, end - now)
            if writable:
                try:
                    self.pending = self.pending[os.write(in_fd, self.pending[:1 << 16]):]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self.pending = b""  # the harness is gone; its exit shows below
            for fd in readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_fds.discard(fd)
                    self.v_closed = self.v_closed or fd == v_fd  # the judge is gone: no more verdicts
                elif fd == err_fd:
                    self.stderr = (self.stderr + chunk)[-4096:]
                else:
                    buf = bufs[fd]  # the verdicts' buffer is self.vbuf: finish() drains into the same one
                    buf += chunk
                    *lines, rest = bytes(buf).split(b"\n")
                    buf[:] = rest
                    for line in lines:
                        (self._handle if fd == out_fd else self._verdict)(line)
                    if len(rest) > (self.line_cap if fd == out_fd else self.verdict_cap):
                        self.reason = "harness output too long" if fd == out_fd else "verdict too long"
                        return
        if not self.judged:
            self.reason = self.reason or "judge or harness exited early"

    def _drain_verdicts(self) -> None:
        """What the judge has written so far (its pid first, then finished tests' verdicts), without waiting."""
        if self.v_closed or self.judged:
            return
        self.vsock.setblocking(False)
        try:
            while True:
                chunk = self.vsock.recv(1 << 16)
                if not chunk:
                    break
                self.vbuf += chunk
        except OSError:  # nothing more for now
            pass
        *lines, rest = bytes(self.vbuf).split(b"\n")
        self.vbuf = bytearray(rest)
        for line in lines:
            self._verdict(line)

    def finish(self, ns_mode: bool) -> bool:
        """Make sure nothing of the sandbox runs; True when the harness ended by itself."""
        clean = self.done
        self._drain_verdicts()
        if self.judge_pidfd is not None:
            if not self.judged:  # past its deadline (or cut off): the judge's child goes too
                try:
                    signal.pidfd_send_signal(self.judge_pidfd, signal.SIGKILL)
                except OSError:
                    pass
            os.close(self.judge_pidfd)
        self.vsock.close()
        if clean:
            try:
                self.proc.wait(timeout=CLEANUP_S)
            except subprocess.TimeoutExpired:
                clean = False
        if not clean:
            self._kill(ns_mode)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        for i, v in enumerate(self.verdicts):  # no verdict: the test ran out of time, or the judge died
            if v is None:
                rec = self.records[i] or {}
                self.verdicts[i] = (False, "timeout" if i == self.current or rec.get("status") == "timeout"
                                    or self.reason == "deadline" else "no_verdict")
        return clean

    def _kill(self, ns_mode: bool) -> None:
        # Kill the namespace's pid 1 first and let the outer bwrap/unshare reap it: killing the outer one
        # first would orphan pid 1 to the host's init, which may never reap its zombie.
        victims = _children(self.proc.pid) if ns_mode else _descendants(self.proc.pid)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if ns_mode:
            try:
                self.proc.wait(timeout=CLEANUP_S / 2)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        if not ns_mode:
            for pid in victims:  # orphans re-parented to us (subreaper) while dying
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


@functools.lru_cache(maxsize=None)
def _subreaper_once() -> bool:
    sandbox_uids.become_subreaper()
    return True


def run_tests(code: str, tests: list[dict], limits: Limits, info: SandboxInfo,
              outputs: list | None = None) -> list[tuple[bool, str]]:
    """Run ``code`` in the sandbox against judge ``tests`` (``{"kind": "call", "src", "names"}`` or
    ``{"kind": "stdio", "stdin", "expected"}``, see _judge.py); return one ``(passed, why)`` per test.
    A ``{"kind": "stdio", "stdin", "capture": N}`` test passes when the program exits 0, and its stdout, as
    text cut to N characters by the judge, is appended to ``outputs`` (one string per test; the only value
    that leaves the sandbox, for tools of `rewards.envs`). Raises SandboxError on infrastructure failures
    (the sandbox did not start)."""
    ns_mode = info.mode in ("bwrap", "unshare")
    harness = harness_code(info.python)  # before anything starts: a failure here leaves nothing behind
    chan = verdicts = None
    judge_job = {"tests": tests, "test_timeout_s": limits.test_timeout_s, "total_timeout_s": limits.total_timeout_s,
                 "max_output_bytes": limits.max_output_bytes,
                 "memory_bytes": max(2 << 30, 2 * (limits.memory_mb << 20))}
    job = {"code": code, "total_timeout_s": limits.total_timeout_s, "max_output_bytes": limits.max_output_bytes,
           "kill_all": info.dedicated_uid or ns_mode, "sys_path": [os.path.realpath(p) for p in limits.site_packages],
           "private_tmp_bytes": (limits.tmp_mb << 20) if info.mode == "unshare" else 0,
           "limits": {"cpu_s": int(limits.test_timeout_s) + 2, "memory_bytes": limits.memory_mb << 20,
                      "max_procs": limits.max_procs, "file_size_bytes": limits.file_size_mb << 20,
                      "open_files": limits.open_files}}
    if not ns_mode:
        _subreaper_once()
    end = time.monotonic() + wall_bound_s(limits)  # the whole call, clean-up included, ends by then
    slot = Slot(info.dedicated_uid)
    try:
        # the judge's test runners take a sandbox uid of their own: test code has no more authority than the
        # candidate, and neither can signal the other (the harness's kill(-1) as the candidate's uid after
        # each test, in rlimits mode, would reach a runner of that uid)
        with slot as uid, Slot(info.dedicated_uid) as runner_uid:
            chan, verdicts = judge_proc.open_sample(dict(judge_job, uid=runner_uid))
            job["channel_fd"] = chan.fileno()
            work = None if ns_mode else tempfile.mkdtemp(prefix="ebpo-sbx-")
            try:
                if work and uid is not None:
                    os.chown(work, uid, uid)
                job["workdir"] = work  # the harness removes it itself if we die
                home = work or "/tmp"
                proc = subprocess.Popen(_command(info, limits), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, cwd=work or "/",
                                        env=dict(SAFE_ENV, HOME=home, TMPDIR=home), pass_fds=(chan.fileno(),),
                                        start_new_session=True, **_user_kwargs(uid))
                chan.close()  # the harness holds it now: when the sandbox dies the judge sees EOF
                stdin = b"%010d" % len(harness) + harness + (json.dumps(job) + "\n").encode()
                session = _Session(proc, stdin, limits, len(tests), verdicts,
                                   max((int(t.get("capture") or 0) for t in tests), default=0))
                try:
                    session.run()
                finally:
                    slot.dirty = not session.finish(ns_mode)
            finally:
                # what is left past the budget is finished in the background (sandbox_cleaner), the uid
                # held until then; the work dir, owned by the uid, is one of its leftovers
                cleanup_end = max(end - CLEANUP_MARGIN_S, time.monotonic() + 0.05)
                if uid is not None and not ns_mode:
                    slot.sweep()  # before deleting: nothing of the sandbox may still write there
                    slot.clean(cleanup_end)
                if work and not remove_path(work, cleanup_end):
                    sandbox_cleaner.submit(lambda deadline: remove_path(work, deadline), lambda _: None)
    finally:
        for sock in (chan, verdicts):
            if sock is not None:
                sock.close()
    if session.infra_error is not None:
        raise SandboxError(f"the judge could not run the tests: {session.infra_error}")
    if session.ready is None:
        raise SandboxError(f"sandbox ({info.mode}) did not start: rc={proc.returncode} {session.reason} "
                           f"stderr={session.stderr.decode('utf-8', 'replace')[-300:]!r}")
    if outputs is not None:
        outputs.extend(session.outputs)
    return session.verdicts
