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
import gc
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
    """The test's time is up (raised by SIGALRM, repeated until the test gives up). The test is failed
    when it is raised, so test code that catches it (a bare ``except:``) cannot turn a hang into a pass."""


# Exceptions the interpreter itself reads as "the iteration is over": raised by the candidate inside
# test code they would end an enclosing ``for ... in map(f, ...)`` or ``all(map(...))`` silently, so the
# test would pass without checking anything (PEP 479's reason). The candidate's raising one is a failed call.
_ITERATION_ENDS = ("StopIteration", "StopAsyncIteration")
# What the harness itself reports about a call (its own records, never the candidate's)
_HARNESS_WHY = ("timeout", "died", "output_limit")


def record_cap(max_output_bytes):
    """The longest line the harness sends for a test whose output it bounds at ``max_output_bytes`` raw bytes:
    a stdio record carries that stdout as escaped JSON, where one byte costs up to 6 (a control byte, or an
    invalid one decoded as U+FFFD, is written ``\\uXXXX``; any other character costs at most 3 bytes per byte,
    12 for a 4-byte one), plus the record's own fields. A candidate's answer line is forwarded as written,
    at most ``max_output_bytes``."""
    return 6 * max_output_bytes + 4096


class _Chan:
    """The sample's channel to the harness: numbered requests, answers read line by line."""

    def __init__(self, sock, cap):
        self.sock, self.cap, self.buf, self.seq = sock, cap, b"", 0
        self.skipping = False  # a line was cut at the cap: the rest of it is dropped when it comes
        self.end = None  # the sample's deadline, known once the harness is ready
        self.total = self.test_timeout = 0.0

    def ready(self):
        """The harness is up: the sample's clock starts, and the running test's alarm gets its budget."""
        if self.end is None:
            self.end = time.monotonic() + self.total
            signal.setitimer(signal.ITIMER_REAL, max(0.001, min(self.test_timeout, self.total)), 0.05)

    def send(self, msg):
        self.send_many([msg])

    def send_many(self, msgs):
        """Lines in one write; SIGALRM is held meanwhile, so a deadline never leaves half a line behind."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            self.sock.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


class _Test:
    """State of the test being judged: what went wrong, and the last exception the candidate raised."""

    def __init__(self, chan):
        self.chan = chan
        self.failed = None   # why a call failed: the test fails whatever the test code does after it
        self.raised = None   # type name of the candidate's last exception
        self.prefetch = None  # (call key, seq) of the call sent with the test's start

    def request(self, msg, expect):
        """Send one request; return the candidate's answer (see interpret), or raise CallFailed."""
        self.chan.seq += 1
        self.chan.send(dict(msg, seq=self.chan.seq))
        return self.wait(self.chan.seq, expect)

    def wait(self, want, expect):
        """The answer to request ``want``; answers to earlier requests (that timed out here, or a
        prefetched call the test did not make) are dropped. The harness marks its own records with an
        ``h`` after the number (``<seq>h {...}``); a line the candidate wrote is always ``<seq> <line>``,
        so it can never pass for one of them."""
        mine, ours = b"%d" % want, b"%dh" % want
        while True:
            seq, _, body = self._line().partition(b" ")
            if seq == mine:
                return interpret(body, self, expect)
            if seq == ours:
                return interpret(body, self, expect, harness=True)
            if seq == b"0h" and body == b'{"ready": 1}':  # written by the harness, before any candidate
                self.chan.ready()

    def _line(self):
        """The next line from the harness; a line longer than the channel's cap fails the call
        (``output_limit``) and is dropped whole, however it arrives: its tail is never read as lines."""
        ch = self.chan
        while True:
            nl = ch.buf.find(b"\n")
            if nl > ch.cap or (nl < 0 and len(ch.buf) > ch.cap):
                ch.buf, ch.skipping = (ch.buf[nl + 1:], False) if nl >= 0 else (b"", True)
                self.fail("output_limit")
            if nl >= 0:
                line, ch.buf = ch.buf[:nl], ch.buf[nl + 1:]
                return line
            chunk = ch.sock.recv(1 << 20)
            if not chunk:
                self.fail("died")
            if ch.skipping:  # the tail of a line cut at the cap
                nl = chunk.find(b"\n")
                if nl < 0:
                    continue
                chunk, ch.skipping = chunk[nl + 1:], False
            ch.buf += chunk

    def fail(self, why):
        self.failed = self.failed or why
        raise CallFailed(why)


def interpret(body, test, expect, harness=False):
    """What one answer line means, for a request of kind ``expect`` ("call", "resolve" or "stdio");
    ``harness``: the line is the harness's own record (stdio results, and why a call got no answer),
    else the candidate wrote it. Every branch ends in a plain value, an exception of the judge's own
    builtins, or CallFailed; the last branch takes any record not foreseen as a failed call. What goes
    into the outcome (``test.failed``, ``test.raised``) is one of a fixed set of words, or an
    identifier after ``raised:``: the candidate cannot write a status that people read."""
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return test.fail("bad_record")
    if type(msg) is not dict:
        return test.fail("bad_record")
    if harness:
        if expect == "stdio" and type(msg.get("stdout")) is str:
            return msg
        if msg.get("h") in _HARNESS_WHY:
            return test.fail(msg["h"])
        return test.fail("bad_record")
    if expect == "call" and "v" in msg:
        try:
            return plain_decode(msg["v"])
        except PlainError:
            return test.fail("bad_value")
    if expect == "resolve" and type(msg.get("names")) is dict:
        return msg["names"]
    name = msg.get("raised")
    if type(name) is str and len(name) <= 40 and name.isascii() and name.isidentifier():
        test.raised = name
        cls = getattr(builtins, name, None)
        if name in _ITERATION_ENDS:
            return test.fail("raised:" + name)
        if expect == "call" and isinstance(cls, type) and issubclass(cls, Exception):
            raise cls("raised by the candidate")  # test code may expect it (``except ValueError``)
        return test.fail("raised:" + name)
    if "bad" in msg and len(msg) == 1:
        return test.fail("bad_value")
    return test.fail("bad_record")  # anything else: a failed call, never a pass


def _proxy(test, name):
    def call(*args, **kwargs):
        try:
            a, k = plain_encode(list(args)), plain_encode(dict(kwargs))
        except PlainError:
            return test.fail("bad_argument")
        first, test.prefetch = test.prefetch, None
        if first and first[0] == (name, json.dumps(a), json.dumps(k)):  # sent with the start: answered already
            return test.wait(first[1], "call")
        return test.request({"op": "call", "name": name, "args": a, "kwargs": k}, "call")
    call.__name__ = call.__qualname__ = name
    return call


def start_message(ch, spec):
    """The start of a call test (numbered on ``ch``), with the test's one call when it has one (literal
    arguments, see code_tests.first_call), so that its answer is ready when the test asks; returns the
    message and the prefetch record ``(call key, seq)`` or None."""
    ch.seq += 1
    msg = {"op": "start", "seq": ch.seq, "i": spec["i"], "kind": "call", "budget": spec["budget"],
           "names": spec["names"]}
    first, prefetch = spec.get("first"), None
    if first:
        ch.seq += 1
        msg["first"] = {"op": "call", "seq": ch.seq, "name": first["name"], "args": first["args"],
                        "kwargs": first["kwargs"]}
        prefetch = ((first["name"], json.dumps(first["args"]), json.dumps(first["kwargs"])), ch.seq)
    return msg, prefetch


def _bind(test, spec, scope):
    """Start the test's candidate process (unless it was started ahead, see judge_sample); bind each name
    the test needs to what the candidate reports."""
    sent = spec.get("sent")
    if sent is None:
        msg, prefetch = start_message(test.chan, spec)
        test.chan.send(msg)
        sent = (msg["seq"], prefetch)
    test.prefetch = sent[1]
    kinds = test.wait(sent[0], "resolve")
    for name in spec["names"]:
        kind = kinds.get(name)
        if kind == ["fn"]:
            scope[name] = _proxy(test, name)
        elif type(kind) is list and len(kind) == 2 and kind[0] == "v":
            try:
                scope[name] = plain_decode(kind[1])
            except PlainError:
                test.fail("bad_value")
        else:  # missing or not plain: unbound (not the prompt's), the test sees a NameError
            scope.pop(name, None)


def _self_contained(spec):
    """A call test whose only use of the candidate is its one prefetched call: it sends nothing after
    its start, so its start can go ahead of the tests before it (the harness runs them in order)."""
    first = spec.get("first")
    return spec["kind"] == "call" and first is not None and spec["names"] == [first["name"]]


def _send_ahead(ch, tests, i):
    """Start every self-contained test from ``i`` on, in one write; returns how many."""
    msgs, j = [], i
    while j < len(tests) and _self_contained(tests[j]):
        spec = dict(tests[j], i=j, budget=ch.test_timeout)  # the harness cuts it to the sample's total
        msg, prefetch = start_message(ch, spec)
        tests[j] = dict(tests[j], sent=(msg["seq"], prefetch))
        msgs.append(msg)
        j += 1
    if msgs:
        ch.send_many(msgs)
    return j - i


def _normalize_output(text):
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


_CODE = {}


def _compiled(src, label):
    """Compiled once per sample (a prompt's helpers serve every test of it)."""
    if src not in _CODE:
        _CODE[src] = compile(src, label, "exec")
    return _CODE[src]


def _run_one(test, spec):
    """Run one test; return (passed, why)."""
    if spec["kind"] == "stdio":
        out = test.request({"op": "start", "i": spec["i"], "kind": "stdio", "budget": spec["budget"],
                            "stdin": spec["stdin"]}, "stdio")
        if out.get("status") != "ok":
            return False, str(out.get("status"))[:40]
        if spec.get("capture"):  # a tool call: its stdout is the value (text, cut to the spec's bound)
            test.captured = out["stdout"][: int(spec["capture"])] if type(out.get("stdout")) is str else ""
            return out.get("exit") == 0, "ok" if out.get("exit") == 0 else "nonzero_exit"
        if out.get("exit") != 0:
            return False, "nonzero_exit"
        ok = _normalize_output(out["stdout"]) == _normalize_output(spec["expected"])
        return ok, "ok" if ok else "wrong_output"
    scope = {"__name__": "__judge__", "__builtins__": builtins}
    for m in _PARENT_MODULES:
        scope[m] = importlib.import_module(m)
    if spec.get("prelude"):  # helpers the task's prompt defines: trusted task code, run here
        exec(_compiled(spec["prelude"], "<prompt helpers>"), scope)
    _bind(test, spec, scope)
    exec(compile(spec["src"], "<test %d>" % spec["i"], "exec"), scope)
    return True, "ok"


def _guarded(test, spec):
    try:
        return _run_one(test, spec)
    finally:
        _ARMED[0] = None  # from here on SIGALRM is ignored: the verdict below is not interrupted


def _verdict(test, spec):
    _ARMED[0] = test
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


_ARMED = [None]  # the test whose deadline SIGALRM enforces now (None: the alarm is ignored)


def _alarm(*_):
    test = _ARMED[0]
    if test is not None:
        # failed before it is raised: test code that catches it (``except:``) cannot make it a pass
        test.failed = test.failed or "timeout"
        raise Deadline()


def judge_sample(job, chan, out):
    """Run every test of one sample in order, each within its own deadline and the sample's total. The
    sample's clock starts when the harness says it is ready (its start-up has the parent's margin); the
    first test is sent before that, so the sandbox starts it at once, and its alarm is re-armed then."""
    out.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    signal.signal(signal.SIGALRM, _alarm)
    ch = _Chan(chan, record_cap(job["max_output_bytes"]))
    ch.total, ch.test_timeout = job["total_timeout_s"], job["test_timeout_s"]
    tests, ahead = list(job["tests"]), 0
    for i, spec in enumerate(tests):
        # Self-contained tests are started in runs, ahead of their verdicts: the harness runs them back
        # to back and enforces their deadlines (each its own timeout, cut to the sample's total).
        if not ahead:
            ahead = _send_ahead(ch, tests, i)
        ahead = max(0, ahead - 1)  # how many of the tests after this one are started already
        spec = tests[i]
        # each test's deadline is its own timeout, cut to what is left of the sample's total
        budget = ch.test_timeout if ch.end is None else min(ch.test_timeout, ch.end - time.monotonic())
        if budget <= 0.001 and "sent" not in spec:  # the total is spent: the rest time out without starting
            out.sendall(json.dumps({"i": i, "ok": False, "why": "timeout", "budget": 1}).encode() + b"\n")
            continue
        budget = max(budget, 0.05)  # started ahead: the harness answers at once that its time is up
        test = _Test(ch)
        # before the harness is ready: a generous alarm, re-armed with the real budget at ready
        signal.setitimer(signal.ITIMER_REAL, budget if ch.end is not None else budget + ch.total, 0.05)
        try:
            ok, why = _verdict(test, dict(spec, i=i, budget=budget))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        verdict = {"i": i, "ok": bool(ok), "why": str(why)[:60]}
        if spec.get("capture"):  # text only, bounded: the one value that leaves for a sandboxed tool
            verdict["out"] = str(getattr(test, "captured", ""))[: int(spec["capture"])]
        out.sendall(json.dumps(verdict).encode() + b"\n")
    try:
        ch.send({"op": "bye"})  # the next start, or bye, ends the test before it
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
    # What exists now is never collected: the children's garbage collector then does not walk (and so
    # copy, page by page) the memory they share with us.
    gc.collect()
    gc.freeze()
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
