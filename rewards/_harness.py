"""Trusted test harness, run INSIDE the sandbox (``python -I -B -c <bootstrap>`` reads this source from stdin).

Standard library only, Python >= 3.9 (the sandbox interpreter may not be ours). This process never
executes candidate code: every test runs in a forked child with its own process group, rlimits, a
per-test deadline and a capped output pipe. Children report *values* (the candidate's return values
serialised as tagged plain data, or its stdout, or an exit status); expected values never enter the
sandbox, so the verdict is computed by the parent outside it. The harness forwards what a child wrote as
an opaque string and never parses it.

Protocol. stdin: this source (length-prefixed, read by the bootstrap), one JSON line (the job), then kept
open as a lifeline: EOF means the parent is gone and the harness kills everything and exits. stdout, one
JSON object per line: {"ready": 1, ...}, {"start": i} before test i, one record per test, {"done": 1}.

Containment. In the ``bwrap``/``unshare`` modes this process is pid 1 of the sandbox's pid namespace:
signals from inside the namespace cannot stop or kill it, orphans are re-parented to it, and when it
exits the kernel kills everything left in the namespace. Otherwise it makes itself a child subreaper.
After every test it kills every other process it can (``kill(-1)``, one sweep that cannot race a fork)
when that is safe (pid 1 of a namespace, or a dedicated uid), then reaps every zombie.
"""
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

_REAL_BUILTINS = dict(__builtins__.__dict__) if hasattr(__builtins__, "__dict__") else dict(__builtins__)
_MAX_DEPTH = 64
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 4, 24, 36, 38
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18


def _encode(v, depth=0):
    """Tagged plain data; only exact builtin types (a subclass with a lying __eq__ is rejected)."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None:
        return ["n"]
    if t is bool:
        return ["b", v]
    if t is int:
        return ["i", str(v)]
    if t is float:
        return ["f", repr(v)]
    if t is complex:
        return ["c", repr(v.real), repr(v.imag)]
    if t is str:
        return ["s", v]
    if t is bytes:
        return ["y", v.hex()]
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        return [tag, [_encode(x, depth + 1) for x in v]]
    if t is dict:
        return ["d", [[_encode(k, depth + 1), _encode(x, depth + 1)] for k, x in v.items()]]
    raise TypeError("unsupported result type " + t.__name__)


# ---- process set-up -------------------------------------------------------------------------------

def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount_private_tmp(size_bytes):
    """unshare mode: fresh size-limited tmpfs on /tmp, /dev/shm, /var/tmp in our own mount namespace,
    then drop every capability so nothing the candidate runs can unmount them (or mount anything)."""
    libc = _libc()

    def mount(src, target, fstype, flags, data):
        if libc.mount(src, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "mount %s: %s" % (target, os.strerror(err)))

    mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
    for target in ("/tmp", "/dev/shm", "/var/tmp"):
        if os.path.isdir(target):
            mount(b"tmpfs", target, b"tmpfs", _MS_NOSUID | _MS_NODEV, ("size=%d,mode=1777" % size_bytes).encode())
    for cap in range(64):  # empty bounding set: exec cannot regain capabilities as uid 0 in the user ns
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _harden_self():
    """Non-dumpable (children of the same uid cannot ptrace us or open /proc/<us>/fd/*); subreaper so
    orphans come to us to be killed and reaped (pid 1 of a namespace gets them anyway)."""
    try:
        libc = _libc()
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:
        pass


def _set_limits(lim):
    pairs = [(resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_bytes"]),
             (resource.RLIMIT_NPROC, lim["max_procs"]), (resource.RLIMIT_FSIZE, lim["file_size_bytes"]),
             (resource.RLIMIT_NOFILE, lim["open_files"]), (resource.RLIMIT_CORE, 0)]
    for res, val in pairs:
        try:
            resource.setrlimit(res, (val, val))
        except (ValueError, OSError):
            pass


# ---- children (candidate code runs only here) ------------------------------------------------------

def _child_common(job, stdin_fd, stdout_fd, keep_fd):
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd, src in enumerate((stdin_fd, stdout_fd, None)):
        os.dup2(devnull if src is None else src, fd)
    for fd in range(3, 1024):  # our stdout, the lifeline and the job's pipes must not reach the candidate
        if fd != keep_fd:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _set_limits(job["limits"])
    sys.path.extend(job.get("sys_path", []))


def _namespace(name):
    return {"__name__": name, "__builtins__": __builtins__}


def _probe_child(job, exprs, result_w):
    _child_common(job, None, None, result_w)
    try:
        ns = _namespace("solution")
        exec(compile(job["code"], "<solution>", "exec"), ns)
        vals = []
        for expr, names in exprs:
            g = dict(ns)
            g.update({n: _REAL_BUILTINS[n] for n in names if n in _REAL_BUILTINS})
            vals.append(_encode(eval(compile(expr, "<test>", "eval"), g)))
        payload = {"values": vals}
    except BaseException as e:  # SystemExit included: exiting early is a failure, not a pass
        payload = {"error": type(e).__name__}
    data = json.dumps(payload).encode()
    while data:
        data = data[os.write(result_w, data):]
    os._exit(0)


def _program_child(job, test, _unused):
    """Program test: only the exit status counts, and only the per-call code drawn by the parent."""
    _child_common(job, None, None, None)
    try:
        ns = _namespace("solution")
        exec(compile(job["code"], "<solution>", "exec"), ns)
        exec(compile(test["src"], "<test>", "exec"), ns)
    except BaseException:
        os._exit(1)
    os._exit(test["exit_code"])


def _stdio_child(job, stdin_fd, out_w):
    import io
    _child_common(job, stdin_fd, out_w, None)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    status = 0
    try:
        exec(compile(job["code"], "<solution>", "exec"), _namespace("__main__"))
    except SystemExit as e:
        status = 0 if e.code in (None, 0) else 1
    except BaseException:
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = 1
    os._exit(status)


# ---- running, killing, reaping ---------------------------------------------------------------------

class _Reaper:
    """Reaps every child (orphans are re-parented to us); remembers the exit code of the one we watch."""

    def __init__(self, watched):
        self.watched, self.exit_code, self.exited = watched, None, False

    def reap(self, block=False):
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return False  # no children left
            if pid == 0:
                return True
            if pid == self.watched:
                self.exited, self.exit_code = True, os.waitstatus_to_exitcode(status)


def _check_lifeline():
    """The parent keeps our stdin open; EOF means it is gone: kill everything, remove a host work dir
    (rlimits mode; the namespace modes have none) and leave."""
    if select.select([0], [], [], 0)[0] and not os.read(0, 4096):
        _sweep(_STATE["kill_all"])
        if _STATE.get("workdir"):
            import shutil
            shutil.rmtree(_STATE["workdir"], ignore_errors=True)
        os._exit(3)


def _pidfd(pid):
    """A descriptor that becomes readable when ``pid`` exits (Linux >= 5.3), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _run(target, args, read_fd, close_fds, deadline, cap):
    """Fork ``target(*args)``, read ``read_fd`` until EOF/cap/deadline; return (status, bytes, reaper)."""
    pid = os.fork()
    if pid == 0:
        try:
            target(*args)
        finally:
            os._exit(1)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    for fd in close_fds:
        os.close(fd)
    pidfd = _pidfd(pid)
    reaper, buf, status, eof = _Reaper(pid), bytearray(), "ok", read_fd is None
    while True:
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        fds = [0] + ([] if eof else [read_fd]) + ([pidfd] if pidfd is not None else [])
        wait = 0.05 if pidfd is not None or not eof else 0.002  # without a pidfd, poll for the exit
        ready = select.select(fds, [], [], min(deadline - now, wait))[0]
        if 0 in ready:
            _check_lifeline()
        if not eof and read_fd in ready:
            chunk = os.read(read_fd, 65536)
            eof = not chunk
            buf += chunk
            if len(buf) > cap:
                status = "output_limit"
                break
            continue
        reaper.reap()
        if reaper.exited:
            if pidfd is not None:
                os.close(pidfd)
                pidfd = None
            if eof or read_fd not in select.select([read_fd], [], [], 0)[0]:
                break  # child gone and nothing more to read (a grandchild may hold the pipe: not waited for)
    if pidfd is not None:
        os.close(pidfd)
    if read_fd is not None:
        os.close(read_fd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    return status, bytes(buf), reaper


def _children():
    """Our direct children (orphans included, we are their subreaper)."""
    out = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open("/proc/self/task/%s/children" % tid) as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def _sweep(kill_all, reaper=None):
    """Kill whatever the test left behind, then reap every zombie (bounded wait)."""
    reaper = reaper or _Reaper(None)
    if kill_all:  # pid 1 of a namespace or a dedicated uid: one atomic sweep
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        if not kill_all:  # same uid as the caller: kill only our own descendants (best effort)
            for pid in _children():
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        if not reaper.reap():
            return
        time.sleep(0.002)


def _stdin_fd(text):
    data = text.encode("utf-8", "surrogateescape")
    try:
        fd = os.memfd_create("stdin")
    except (AttributeError, OSError):  # no memfd: an unlinked file in our private cwd
        path = "_stdin_%d" % os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
    while data:
        data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_test(job, i, test, deadline):
    cap = job["max_output_bytes"]
    if test["kind"] == "program":
        status, _, reaper = _run(_program_child, (job, test, None), None, [], deadline, cap)
        return {"i": i, "status": status, "exit": reaper.exit_code}, reaper
    r, w = os.pipe()
    if test["kind"] == "stdio":
        in_fd = _stdin_fd(test["stdin"])
        status, out, reaper = _run(_stdio_child, (job, in_fd, w), r, [w, in_fd], deadline, cap)
        return {"i": i, "status": status, "exit": reaper.exit_code,
                "stdout": out.decode("utf-8", "replace")}, reaper
    status, out, reaper = _run(_probe_child, (job, test["exprs"], w), r, [w], deadline, cap)
    return {"i": i, "status": status, "exit": reaper.exit_code, "payload": out.decode("utf-8", "replace")}, reaper


_STATE = {"kill_all": False}


def _emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _read_job():
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = os.read(0, 1 << 20)
        if not chunk:
            raise SystemExit("harness: no job on stdin")
        buf += chunk
    return json.loads(buf.decode())


def main():
    job = _read_job()
    if job.get("private_tmp_bytes"):
        _mount_private_tmp(job["private_tmp_bytes"])
        os.chdir("/tmp")
    _harden_self()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    pid1 = os.getpid() == 1
    _STATE["kill_all"] = kill_all = job["kill_all"] or pid1
    _STATE["workdir"] = job.get("workdir")
    end = time.monotonic() + job["total_timeout_s"]
    _emit({"ready": 1, "pid1": pid1, "python": list(sys.version_info[:3])})
    for i, test in enumerate(job["tests"]):
        deadline = min(time.monotonic() + job["test_timeout_s"], end)
        if deadline <= time.monotonic():
            _emit({"i": i, "status": "timeout", "budget": 1})
            continue
        _emit({"start": i})
        rec, reaper = _run_test(job, i, test, deadline)
        _sweep(kill_all, reaper)
        rec["exit"] = reaper.exit_code
        _emit(rec)
    _emit({"done": 1})


if __name__ == "__main__":
    main()
