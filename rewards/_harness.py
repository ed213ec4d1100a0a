"""Trusted harness, run INSIDE the sandbox (``python -I -B -c <bootstrap>`` reads this source, after
``_plain.py``'s, from stdin).

Standard library only, Python >= 3.9 (the sandbox interpreter may not be ours). This process never
executes candidate code and holds nothing of the verdict: it starts one candidate process per test when
the judge asks, relays the judge's requests to it and its answers back, and enforces the deadlines. The
judge (``_judge.py``, outside the sandbox) has the test code run by its confined runners; the candidate
answers with plain data only (``_plain.py``), and the harness forwards each answer line untouched,
prefixed with the number of the request it answers, so a late answer can never be taken for the answer
to a later request.

Protocol. stdin: this source (length-prefixed, read by the bootstrap), one JSON line (the job), then kept
open as a lifeline: EOF means the parent is gone and the harness kills everything and exits. The job
names the inherited descriptor of the judge's channel. Channel, judge to harness, one JSON line each:
``{"op": "start", "seq", "i", "kind": "call"|"stdio", "budget", "names"|"stdin"}`` (a call test's
candidate answers which of ``names`` it defines, and as what), ``{"op": "call", "seq", ...}`` (forwarded
to the candidate), ``{"op": "bye"}`` (the next start, or bye, ends the test before it). Harness to
judge: ``<seq> <answer line>`` (the candidate's answer, forwarded untouched) or ``<seq>h <record>`` (our
own record: a stdio result, or why a call got no answer; the candidate cannot write one). stdout, for the
parent: ``{"ready": 1, ...}``, ``{"start": i}``, ``{"i": i, "status"}`` after each test, ``{"done": 1}``.

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

try:  # run, this file comes after _plain.py's source; imported (by tests, by linters), it imports it
    plain_encode  # noqa: B018
except NameError:
    from rewards._plain import PlainError, plain_decode, plain_encode

_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 4, 24, 36, 38
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18


# ---- process set-up -------------------------------------------------------------------------------

def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount_private_tmp(size_bytes):
    """unshare mode: fresh size-limited tmpfs on /tmp, /dev/shm, /var/tmp and /run in our own mount
    namespace (the host's unix sockets live under /run and /tmp: connect() needs only write permission on
    the socket file, and no network namespace covers it), then drop every capability so nothing the
    candidate runs can unmount them (or mount anything)."""
    libc = _libc()

    def mount(src, target, fstype, flags, data):
        if libc.mount(src, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "mount %s: %s" % (target, os.strerror(err)))

    mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
    for target in ("/tmp", "/dev/shm", "/var/tmp", "/run"):
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


# ---- candidate processes (candidate code runs only here) -------------------------------------------

def _child_common(job, stdin_fd, stdout_fd, keep_fds=()):
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd, src in enumerate((stdin_fd, stdout_fd, None)):
        os.dup2(devnull if src is None else src, fd)
    # our stdout, the lifeline and the judge's channel must not reach the candidate: close every other
    # descriptor, whatever its number (the channel keeps the number it has in the reward process, which
    # holds more than 1024 descriptors in a busy trainer)
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = range(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    for fd in fds:
        if fd > 2 and fd not in keep_fds:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _set_limits(job["limits"])
    sys.path.extend(job.get("sys_path", []))


def _answer(ns, failed, req):
    """The candidate's answer to one request, as a JSON-able dict of plain data."""
    if failed:
        return {"raised": failed}
    if req.get("op") == "resolve":
        kinds = {}
        for name in req.get("names", []):
            if name not in ns:
                kinds[name] = ["missing"]
            elif callable(ns[name]):
                kinds[name] = ["fn"]
            else:
                try:
                    kinds[name] = ["v", plain_encode(ns[name])]
                except PlainError:
                    kinds[name] = ["obj"]
        return {"names": kinds}
    try:
        fn = ns[req["name"]]
        args = plain_decode(req["args"])
        kwargs = plain_decode(req["kwargs"])
    except (KeyError, PlainError):
        return {"raised": "NameError"}
    try:
        value = fn(*args, **kwargs)
    except BaseException as e:  # SystemExit included: the judge decides what an exception means
        return {"raised": type(e).__name__}
    try:
        return {"v": plain_encode(value)}
    except (PlainError, ValueError, RecursionError) as e:  # e.g. an int too long for str()
        return {"bad": str(e)[:80]}


def _serve_child(job, req_fd, ans_fd):
    """One call test's candidate process: run the code, then answer requests, one line each."""
    _child_common(job, None, None, (req_fd, ans_fd))
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    failed = None
    try:
        exec(compile(job["code"], "<solution>", "exec"), ns)
    except BaseException as e:  # exiting at import is a failure of every call, never a pass
        failed = type(e).__name__
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(req_fd, 1 << 16)
            if not chunk:
                os._exit(0)
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        try:
            out = json.dumps(_answer(ns, failed, json.loads(line)))
        except BaseException as e:
            out = json.dumps({"bad": type(e).__name__})
        data = out.encode() + b"\n"
        while data:
            data = data[os.write(ans_fd, data):]


def _stdio_child(job, stdin_fd, out_w):
    import io
    _child_common(job, stdin_fd, out_w)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    status = 0
    try:
        exec(compile(job["code"], "<solution>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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


def _fork(target, args, close_fds):
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
    return pid


def _run_stdio(job, stdin_text, deadline):
    """Run the code as __main__ on ``stdin_text``; return (status, stdout bytes, exit code)."""
    r, w = os.pipe()
    in_fd = _stdin_fd(stdin_text)
    pid = _fork(_stdio_child, (job, in_fd, w), [w, in_fd])
    pidfd, cap = _pidfd(pid), job["max_output_bytes"]
    reaper, buf, status, eof = _Reaper(pid), bytearray(), "ok", False
    while True:
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        fds = [0] + ([] if eof else [r]) + ([pidfd] if pidfd is not None else [])
        wait = 0.05 if pidfd is not None or not eof else 0.002  # without a pidfd, poll for the exit
        ready = select.select(fds, [], [], min(deadline - now, wait))[0]
        if 0 in ready:
            _check_lifeline()
        if not eof and r in ready:
            chunk = os.read(r, 65536)
            eof = not chunk
            buf += chunk
            if len(buf) > cap:
                status = "output_limit"
                break
            continue
        reaper.reap()
        if reaper.exited and (eof or r not in select.select([r], [], [], 0)[0]):
            break  # gone and nothing more to read (a grandchild may hold the pipe: not waited for)
    for fd in [r] + ([pidfd] if pidfd is not None else []):
        os.close(fd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    _sweep(_STATE["kill_all"], reaper)
    return status, bytes(buf), reaper.exit_code


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


_STATE = {"kill_all": False}


def _emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Channel:
    """The judge's channel as a raw descriptor (a socket, read and written with os.read/os.write)."""

    def __init__(self, fd):
        self.fd = fd

    def fileno(self):
        return self.fd

    def sendall(self, data):
        while data:
            data = data[os.write(self.fd, data):]

    def recv(self, n):
        return os.read(self.fd, n)


class _Relay:
    """One test at a time: the candidate process of the current call test, its deadline, its answers."""

    def __init__(self, job, chan, end):
        self.job, self.chan, self.end = job, chan, end
        self.i, self.pid, self.req, self.ans, self.reaper = None, None, None, None, None
        self.deadline, self.status, self.buf = 0.0, "ok", b""

    def send(self, seq, line):
        """Forward the candidate's answer line to request ``seq``, untouched."""
        self.chan.sendall(b"%d " % seq + line + b"\n")

    def own(self, seq, obj):
        """Our own record about request ``seq`` (``<seq>h``): the candidate's lines never carry the ``h``,
        so a line it writes cannot pass for one of ours."""
        self.chan.sendall(b"%dh " % seq + json.dumps(obj).encode() + b"\n")

    def start(self, msg):
        self.finish()
        self.i, self.status, self.buf = msg["i"], "ok", b""
        self.deadline = min(time.monotonic() + float(msg["budget"]), self.end)
        _emit({"start": self.i})
        if msg["kind"] == "stdio":
            status, out, code = _run_stdio(self.job, str(msg.get("stdin", "")), self.deadline)
            self.status = status
            self.own(msg["seq"], {"stdout": out.decode("utf-8", "replace"), "exit": code, "status": status})
            return
        req_r, self.req = os.pipe()  # plain pipes: the socket module costs the sandbox's start-up time
        self.ans, ans_w = os.pipe()
        self.pid = _fork(_serve_child, (self.job, req_r, ans_w), [req_r, ans_w])
        os.set_blocking(self.req, False)
        self.reaper = _Reaper(self.pid)
        # a call test's start carries the names the test needs (resolving them is its first request) and
        # may carry the test's one call, sent at once so that its answer is ready when the judge asks
        requests = [(msg["seq"], json.dumps({"op": "resolve", "names": msg.get("names", [])}).encode())]
        if msg.get("first"):
            requests.append((msg["first"]["seq"], json.dumps(msg["first"]).encode()))
        self.call(requests)

    def kill(self, status):
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            pidfd = _pidfd(self.pid)
            if pidfd is not None:  # wake the moment it is gone: the sweep after it then need not poll
                select.select([pidfd], [], [], 1.0)
                os.close(pidfd)
            os.close(self.req)
            os.close(self.ans)
            self.pid = self.req = self.ans = None
            if self.status == "ok":
                self.status = status

    def call(self, requests):
        """Forward requests ``[(seq, line), ...]`` at once; forward one answer line per request, in
        order, each as it comes, until the candidate exits or the deadline passes (then every request
        still unanswered is answered with that)."""
        if self.pid is None:
            for seq, _ in requests:
                self.own(seq, {"h": self.status if self.status != "ok" else "died"})
            return
        pidfd = _pidfd(self.pid)
        try:
            data = b"".join(line + b"\n" for _, line in requests)
            while data:  # a candidate that stops reading costs it its deadline, not ours
                if not select.select([], [self.req], [], max(0.0, self.deadline - time.monotonic()))[1]:
                    raise TimeoutError
                data = data[os.write(self.req, data):]
            for k, (seq, _) in enumerate(requests):
                why = self._answer(seq, pidfd)
                if why:
                    self.kill(why)
                    for later, _ in requests[k:]:
                        self.own(later, {"h": why})
                    return
        except OSError:  # the candidate closed its end or stopped reading until the deadline
            why = "timeout" if time.monotonic() >= self.deadline else "died"
            self.kill(why)
            for seq, _ in requests:  # the judge drops answers to requests it no longer waits for
                self.own(seq, {"h": why})
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _answer(self, seq, pidfd):
        """Wait for one answer line and forward it; return why not (timeout, died, output_limit) or None."""
        cap = self.job["max_output_bytes"]
        while b"\n" not in self.buf:
            now = time.monotonic()
            if now >= self.deadline:
                return "timeout"
            fds = [0, self.ans] + ([pidfd] if pidfd is not None else [])
            ready = select.select(fds, [], [], min(self.deadline - now, 0.05))[0]
            if 0 in ready:
                _check_lifeline()
            if self.ans in ready:
                chunk = os.read(self.ans, 1 << 16)
                if not chunk:
                    return "died"
                self.buf += chunk
                if len(self.buf) > cap and b"\n" not in self.buf[:cap + 1]:
                    return "output_limit"
            elif pidfd is None or pidfd in ready:
                self.reaper.reap()
                if self.reaper.exited and self.ans not in select.select([self.ans], [], [], 0)[0]:
                    return "died"
        answer, self.buf = self.buf.split(b"\n", 1)
        self.send(seq, answer)
        return None

    def finish(self):
        if self.i is None:
            return
        self.kill("ok")
        _sweep(_STATE["kill_all"], self.reaper)
        _emit({"i": self.i, "status": self.status})
        self.i, self.reaper = None, None

    def idle(self):
        """Between requests: the candidate's time runs out at its deadline even while the judge thinks."""
        if self.pid is not None and time.monotonic() >= self.deadline:
            self.kill("timeout")


def _serve(job, relay):
    """Read the judge's requests until it says bye or goes away."""
    buf, chan = b"", relay.chan
    while True:
        wait = max(0.0, relay.deadline - time.monotonic()) if relay.pid is not None else None
        ready = select.select([0, chan], [], [], wait)[0]
        if 0 in ready:
            _check_lifeline()
        relay.idle()
        if chan not in ready:
            continue
        chunk = chan.recv(1 << 20)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            op = msg.get("op")
            if op == "start":
                relay.start(msg)
            elif op == "call":
                relay.call([(msg["seq"], line)])
            elif op == "bye":
                return


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
    _STATE["kill_all"] = job["kill_all"] or pid1
    _STATE["workdir"] = job.get("workdir")
    # the channel keeps the number it had in the reward process, which may be above what select() takes
    chan_fd = os.dup(job["channel_fd"])
    os.close(job["channel_fd"])
    chan = _Channel(chan_fd)
    relay = _Relay(job, chan, time.monotonic() + job["total_timeout_s"])
    _emit({"ready": 1, "pid1": pid1, "python": list(sys.version_info[:3])})
    chan.sendall(b'0h {"ready": 1}\n')  # the judge starts the sample's clock now, as we do
    try:
        _serve(job, relay)
    except OSError:  # the judge went away mid-answer
        pass
    relay.finish()
    _emit({"done": 1})


if __name__ == "__main__":
    main()
