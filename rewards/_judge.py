"""The judge: runs the test code, outside the sandbox, and calls the candidate through the channel.

Started once per reward process (``rewards/judge.py``) as ``python -I -B -c <bootstrap>``, this source
(after ``_plain.py``'s) on stdin. Standard library only. The long-lived process only waits: for each
sample the parent sends the sample's job and two descriptors (the channel to the sandbox's harness, and
the socket the verdicts go back on), and the judge forks a fresh child for that sample, so nothing of
one sample survives into the next. The child holds every secret of the verdict (the test code, expected
outputs); it runs each test with its own builtins and binds each name the test needs from the candidate
to what the candidate reports for it: a plain value, or a proxy that sends the call's arguments as plain
data and returns the answer decoded as plain data (``_plain.py``). Anything else the candidate answers
(an object, an exit, a timeout, garbage) is a failed call: it raises ``CallFailed``, which test code
cannot catch as an ``Exception``, and the test fails whatever the test code does next. Comparisons thus
run here, on plain values, with this process's builtins.
"""
import builtins
import importlib
import json
import os
import resource
import signal
import socket
import sys
import time

try:  # run, this file comes after _plain.py's source; imported (by tests, by linters), it imports it
    plain_encode  # noqa: B018
except NameError:
    from rewards._plain import PlainError, plain_decode, plain_encode

_PARENT_MODULES = ("math", "cmath", "re", "string", "itertools", "functools", "collections", "heapq",
                   "bisect", "fractions", "decimal", "statistics", "operator")


class CallFailed(BaseException):
    """A call the candidate did not answer with plain data (BaseException: ``except Exception`` in test
    code does not swallow it)."""


class Deadline(BaseException):
    """The test's time is up (raised by SIGALRM, repeated until the test gives up)."""


class _Chan:
    """The sample's channel to the harness: numbered requests, answers read line by line."""

    def __init__(self, sock, cap):
        self.sock, self.cap, self.buf, self.seq = sock, cap, b"", 0

    def send(self, msg):
        """One line; SIGALRM is held meanwhile, so a deadline never leaves half a line behind."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


class _Test:
    """State of the test being judged: what went wrong, and the last exception the candidate raised."""

    def __init__(self, chan):
        self.chan = chan
        self.failed = None   # why a call failed: the test fails whatever the test code does after it
        self.raised = None   # type name of the candidate's last exception

    def request(self, msg, expect):
        """Send one request; return the candidate's answer (see interpret), or raise CallFailed."""
        ch = self.chan
        ch.seq += 1
        ch.send(dict(msg, seq=ch.seq))
        while True:
            seq, _, body = self._line().partition(b" ")
            if seq == b"%d" % ch.seq:  # answers to earlier requests (that timed out here) are dropped
                return interpret(body, self, expect)

    def _line(self):
        ch = self.chan
        while b"\n" not in ch.buf:
            if len(ch.buf) > ch.cap:
                ch.buf = b""
                self.fail("output_limit")
            chunk = ch.sock.recv(1 << 20)
            if not chunk:
                self.fail("died")
            ch.buf += chunk
        line, ch.buf = ch.buf.split(b"\n", 1)
        return line

    def fail(self, why):
        self.failed = self.failed or why
        raise CallFailed(why)


def interpret(body, test, expect):
    """What one answer line means, for a request of kind ``expect`` ("call", "resolve" or "stdio"). Runs
    on candidate-written bytes: every branch ends in a plain value, an exception of the judge's own
    builtins, or CallFailed; the last branch takes any record not foreseen as a failed call."""
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return test.fail("bad_record")
    if type(msg) is not dict:
        return test.fail("bad_record")
    if expect == "call" and "v" in msg:
        try:
            return plain_decode(msg["v"])
        except PlainError:
            return test.fail("bad_value")
    if expect == "resolve" and type(msg.get("names")) is dict:
        return msg["names"]
    if expect == "stdio" and type(msg.get("stdout")) is str:
        return msg
    if type(msg.get("raised")) is str:
        test.raised = msg["raised"][:40]
        cls = getattr(builtins, test.raised, None)
        if expect == "call" and isinstance(cls, type) and issubclass(cls, Exception):
            raise cls("raised by the candidate")  # test code may expect it (``except ValueError``)
        return test.fail("raised:" + test.raised)
    if type(msg.get("h")) is str:  # the harness: timeout, died, output_limit
        return test.fail(msg["h"][:40])
    if "bad" in msg:
        return test.fail("bad_value")
    return test.fail("bad_record")  # anything else: a failed call, never a pass


def _proxy(test, name):
    def call(*args, **kwargs):
        try:
            a, k = plain_encode(list(args)), plain_encode(dict(kwargs))
        except PlainError:
            return test.fail("bad_argument")
        return test.request({"op": "call", "name": name, "args": a, "kwargs": k}, "call")
    call.__name__ = call.__qualname__ = name
    return call


def _bind(test, spec, scope):
    """Start the test's candidate process; bind each name the test needs to what the candidate reports."""
    names = spec["names"]
    kinds = test.request({"op": "start", "i": spec["i"], "kind": "call", "budget": spec["budget"],
                          "names": names}, "resolve")
    for name in names:
        kind = kinds.get(name)
        if kind == ["fn"]:
            scope[name] = _proxy(test, name)
        elif type(kind) is list and len(kind) == 2 and kind[0] == "v":
            try:
                scope[name] = plain_decode(kind[1])
            except PlainError:
                test.fail("bad_value")
        # missing or not plain: left unbound, the test sees a NameError


def _normalize_output(text):
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _run_one(test, spec):
    """Run one test; return (passed, why)."""
    if spec["kind"] == "stdio":
        out = test.request({"op": "start", "i": spec["i"], "kind": "stdio", "budget": spec["budget"],
                            "stdin": spec["stdin"]}, "stdio")
        if out.get("status") != "ok":
            return False, str(out.get("status"))[:40]
        if out.get("exit") != 0:
            return False, "nonzero_exit"
        ok = _normalize_output(out["stdout"]) == _normalize_output(spec["expected"])
        return ok, "ok" if ok else "wrong_output"
    scope = {"__name__": "__judge__", "__builtins__": builtins}
    for m in _PARENT_MODULES:
        scope[m] = importlib.import_module(m)
    _bind(test, spec, scope)
    exec(compile(spec["src"], "<test %d>" % spec["i"], "exec"), scope)
    return True, "ok"


def _guarded(test, spec):
    try:
        return _run_one(test, spec)
    finally:
        _ARMED[0] = False  # from here on SIGALRM is ignored: the verdict below is not interrupted


def _verdict(test, spec):
    _ARMED[0] = True
    try:
        ok, why = _guarded(test, spec)
    except Deadline:
        ok, why = False, "timeout"
    except CallFailed as e:
        ok, why = False, str(e)
    except AssertionError:
        ok, why = False, "raised:" + test.raised if test.raised else "assert_failed"
    except BaseException as e:  # the test code's own error, or one the candidate's exception caused
        ok, why = False, "raised:" + test.raised if test.raised else "assert_raised:" + type(e).__name__
    if test.failed:  # a failed call fails the test even when the test code caught it
        return False, test.failed
    return ok, why


_ARMED = [False]


def _alarm(*_):
    if _ARMED[0]:
        raise Deadline()


def judge_sample(job, chan, out):
    """Run every test of one sample in order, each within its own deadline and the sample's total."""
    out.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    signal.signal(signal.SIGALRM, _alarm)
    ch = _Chan(chan, job["max_output_bytes"] + 4096)
    ready = False
    try:  # the sample's clock starts when the sandbox is up (its start-up has the parent's margin)
        ready = _Test(ch)._line() == b'0 {"ready": 1}'
    except (CallFailed, OSError):
        pass
    end = time.monotonic() + (job["total_timeout_s"] if ready else 0.0)
    for i, spec in enumerate(job["tests"]):
        # each test's deadline is its own timeout, cut to what is left of the sample's total
        budget = min(job["test_timeout_s"], end - time.monotonic())
        if budget <= 0.001:  # the total is spent: the remaining tests time out without starting
            out.sendall(json.dumps({"i": i, "ok": False, "why": "timeout", "budget": 1}).encode() + b"\n")
            continue
        test = _Test(ch)
        signal.setitimer(signal.ITIMER_REAL, budget, 0.05)
        try:
            ok, why = _verdict(test, dict(spec, i=i, budget=budget))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            ch.send({"op": "end"})
        except OSError:
            pass
        out.sendall(json.dumps({"i": i, "ok": bool(ok), "why": str(why)[:60]}).encode() + b"\n")
    try:
        ch.send({"op": "bye"})
    except OSError:
        pass
    out.sendall(b'{"done": 1}\n')


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def main():
    """Wait for samples on the control socket; fork one child per sample."""
    import ctypes
    try:  # non-dumpable: a same-uid candidate (rlimits mode without root) cannot ptrace or read us
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    ctl = socket.socket(fileno=int(sys.argv[1]))
    for m in _PARENT_MODULES:  # imported once here, inherited by every sample's child
        importlib.import_module(m)
    while True:
        try:
            head, fds, _, _ = socket.recv_fds(ctl, 10, 2)
            if not head:
                return
            head += _recv_exact(ctl, 10 - len(head))
            job = json.loads(_recv_exact(ctl, int(head)))
        except (EOFError, OSError, ValueError):
            return
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            ctl.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                mem = job.get("memory_bytes")
                if mem:
                    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
                judge_sample(job, socket.socket(fileno=fds[0]), socket.socket(fileno=fds[1]))
            except BaseException:
                code = 1
            os._exit(code)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    main()
