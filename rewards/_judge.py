"""The judge: holds the verdicts, talks to the sandbox's harness, and has each test's code run by a runner.

Started once per reward process (``rewards/judge.py``) as ``python -I -B -c <bootstrap>``, this source
(after ``_plain.py``'s, ``_jail.py``'s and ``_judge_runner.py``'s) on stdin. Standard library only. The
long-lived process only waits: at start it forks the *zygote*, which sets up the jail (``_jail.setup``:
its own mount, network, IPC and UTS namespaces and a read-only tree with the interpreter and its
libraries only) and forks the test runners; for each sample the parent sends the sample's job and two
descriptors (the channel to the sandbox's harness, and the socket the verdicts go back on), and the
judge forks a fresh child for that sample, so nothing of one sample survives into the next.

The child (the *writer*) holds every secret of the verdict and the only socket verdicts go back on, and
never runs test code. Stdio tests it judges itself (a comparison of plain text). For a call test it has
the zygote fork a runner (``_judge_runner.py``): the runner confines itself (the jail tree as its root,
the sample's sandbox uid, no capabilities, no new process, no file writes), gets this test only, runs its
code, asks the writer for each name and call it needs from the candidate, and ends with one verdict
message. The writer makes those requests on the channel (a request for a name the test does not need,
or anything else, is not made), forwards each answer line as it came, fails the test itself on the
harness's own records of a failed call, accepts exactly one verdict from the runner (its outcome word
checked), then kills it. Test code that evaluates what the candidate returns runs with no more authority
than the candidate and can forge its own test's verdict only: it cannot reach the verdict socket, the
other tests, or the next sample.
"""
import gc
import importlib
import json
import os
import resource
import signal
import socket
import sys
import time

try:  # run, this file comes after the others' sources; imported (by tests, by linters), it imports them
    plain_encode  # noqa: B018
except NameError:
    from rewards._jail import non_dumpable
    from rewards._judge_runner import (EXIT, FORK, HARNESS_WHY, ITERATION_ENDS, PARENT_MODULES,  # noqa: F401
                                       CallFailed, compiled_test, interpret, runner_main, valid_why, zygote)
    from rewards._plain import PlainError, plain_decode, plain_encode  # noqa: F401


class Deadline(BaseException):
    """The test's time is up (raised by SIGALRM in the writer, once; the writer then kills the runner)."""


def record_cap(max_output_bytes):
    """The longest line the harness sends for a test whose output it bounds at ``max_output_bytes`` raw bytes:
    a stdio record carries that stdout as escaped JSON, where one byte costs up to 6 (a control byte, or an
    invalid one decoded as U+FFFD, is written ``\\uXXXX``; any other character costs at most 3 bytes per byte,
    12 for a 4-byte one), plus the record's own fields. A candidate's answer line is forwarded as written,
    at most ``max_output_bytes``."""
    return 6 * max_output_bytes + 4096


class _Chan:
    """The sample's channel to the harness: numbered requests, answers read line by line."""

    def __init__(self, sock, cap, runner=None):
        self.sock, self.cap, self.buf, self.seq = sock, cap, b"", 0
        self.runner = runner or {}  # what a runner is started with: the sample's uid, its memory cap
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
    """The writer's state of the test being judged: why it failed, if it did."""

    def __init__(self, chan):
        self.chan = chan
        self.failed = None   # why a call failed: the test fails whatever its runner reports
        self.raised = None   # (interpret's bookkeeping for stdio records; runners keep their own)
        self.runner = None   # the call test's runner, killed once the test is judged

    def request(self, msg, expect):
        """Send one request; return its answer, interpreted (stdio tests: the harness's record)."""
        return self.answer(self.request_raw(msg), expect)

    def request_raw(self, msg):
        self.chan.seq += 1
        self.chan.send(dict(msg, seq=self.chan.seq))
        return self.wait_raw(self.chan.seq)

    def answer(self, raw, expect):
        harness, body = raw
        return interpret(body, self, expect, harness=harness)

    def forwardable(self, raw, expect):
        """An answer for a runner: the candidate's line as it came; the harness's own record about a call
        (why it got no answer) fails the test here, whatever the runner would make of it."""
        harness, body = raw
        if harness:
            interpret(body, self, expect, harness=True)  # always a failed call: raises CallFailed
        return body

    def wait(self, want, expect):
        return self.answer(self.wait_raw(want), expect)

    def wait_raw(self, want):
        """(harness record?, body) of the answer to request ``want``; answers to earlier requests (that timed
        out here, or a prefetched call the test did not make) are dropped. The harness marks its own records
        with an ``h`` after the number (``<seq>h {...}``); a line the candidate wrote is always
        ``<seq> <line>``, so it can never pass for one of them."""
        mine, ours = b"%d" % want, b"%dh" % want
        while True:
            seq, _, body = self._line().partition(b" ")
            if seq == mine:
                return False, body
            if seq == ours:
                return True, body
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


class RunnerError(Exception):
    """A runner could not be started or confined: an infrastructure failure, not the candidate's."""


MIN_BUDGET_S = 0.05  # a test started ahead still gets this long once the sample's total is spent
_RUNNERS = {"zygote": None}  # the zygote's socket (main); None: runners are forked here (in-process tests)


class _Runner:
    """One call test's runner, seen from the writer: its socket, its process, its requests."""

    def __init__(self):
        self.sock, self.buf, self.pid, self.pidfd, self.child = None, b"", None, None, False

    def start(self, job, budget):
        """Have a runner started (by the zygote; forked here where none runs) and wait until it is confined.
        Raises RunnerError when it cannot be started or confined."""
        self.sock, theirs = socket.socketpair()
        cfg = {"uid": job.get("uid"), "memory_bytes": job.get("memory_bytes"), "cpu_s": int(budget) + 2}
        try:
            if _RUNNERS["zygote"] is None:
                self.pid, self.child = FORK(), True
                if self.pid == 0:  # only where no zygote runs (tests): it sees this process's memory
                    self.sock.close()
                    runner_main(theirs, None, cfg["uid"], cfg["memory_bytes"], cfg["cpu_s"])
            else:
                socket.send_fds(_RUNNERS["zygote"], [json.dumps(cfg).encode()], [theirs.fileno()])
        except OSError as e:
            raise RunnerError("cannot start a test runner: %s" % e) from None
        finally:
            theirs.close()
        first = self.message(1 << 12)  # written before the runner is confined, so it is its own
        if not first or type(first.get("pid")) is not int:
            raise RunnerError("the test runner did not start")
        if not self.child:
            self.pid, self.pidfd = first["pid"], os.pidfd_open(first["pid"])
        confined = self.message(1 << 12)  # the same
        if confined is None or confined.get("confined") != 1:
            raise RunnerError("the test runner could not be confined: %s"
                              % str((confined or {}).get("confine_failed", "it exited"))[:200])

    def send(self, flag, body):
        data = b"%d %d\n" % (flag, len(body)) + body
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # a deadline never splits a frame
        try:
            self.sock.sendall(data)
        except OSError:  # the runner is gone: its verdict (or its absence) says the rest
            pass
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})

    def message(self, cap):
        """The runner's next JSON object (lines that are not one are skipped, a line over ``cap`` dropped
        whole), or None when it closed its socket."""
        skipping = False
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line, self.buf = self.buf[:nl], self.buf[nl + 1:]
                if skipping or nl > cap:
                    skipping = False
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError, UnicodeDecodeError):
                    continue
                if type(obj) is dict:
                    return obj
                continue
            if len(self.buf) > cap:
                self.buf, skipping = b"", True
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return None
            self.buf += chunk

    def kill(self):
        """SIGKILL the runner and wait until it is gone (it cannot fork: nothing of it is left after)."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.child and self.pid:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        if self.child and self.pid:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        elif self.pidfd is not None:
            _wait_readable(self.pidfd, 2.0)
        if self.pidfd is not None:
            os.close(self.pidfd)
        if self.sock is not None:
            self.sock.close()


def _wait_readable(fd, timeout_s):
    import select
    p = select.poll()
    p.register(fd, select.POLLIN)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if p.poll(max(0.0, end - time.monotonic()) * 1000):
                return
        except InterruptedError:
            continue


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


def _run_stdio(test, spec):
    """A stdio test, judged here: the harness's record of the program's run, compared as text."""
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


def _runner_verdict(test, v):
    """The runner's one verdict, checked: a pass is exactly ``[true, "ok"]``, a failure names an outcome word."""
    if type(v) is not list or len(v) != 2 or type(v[0]) is not bool or not valid_why(v[1]):
        return False, "bad_verdict"
    if test.failed:
        return False, test.failed
    if v[0]:
        return (True, "ok") if v[1] == "ok" else (False, "bad_verdict")
    return (False, v[1]) if v[1] != "ok" else (False, "bad_verdict")


def _run_call(test, spec):
    """A call test: start the candidate's process (unless it was started ahead), have a runner run the test
    code, and serve its requests until its verdict."""
    sent = spec.get("sent")
    if sent is None:
        msg, prefetch = start_message(test.chan, spec)
        test.chan.send(msg)
        sent = (msg["seq"], prefetch)
    runner = test.runner = _Runner()  # killed by _verdict, where no deadline can interrupt the kill
    runner.start(test.chan.runner, spec["budget"])
    runner.send(0, json.dumps({k: spec.get(k) for k in ("src", "names", "prelude", "i")}).encode())
    prefetch, resolved = sent[1], False
    while True:
        msg = runner.message(test.chan.cap)
        if msg is None:
            return False, test.failed or "test_died"
        if "verdict" in msg:
            return _runner_verdict(test, msg["verdict"])
        if msg.get("op") == "resolve" and not resolved:
            resolved = True
            runner.send(0, test.forwardable(test.wait_raw(sent[0]), "resolve"))
        elif msg.get("op") == "call" and resolved and msg.get("name") in spec["names"]:
            key = (msg["name"], json.dumps(msg.get("args")), json.dumps(msg.get("kwargs")))
            first, prefetch = prefetch, None
            if first and first[0] == key:  # sent with the start: answered already
                raw = test.wait_raw(first[1])
            else:
                raw = test.request_raw({"op": "call", "name": msg["name"], "args": msg.get("args"),
                                        "kwargs": msg.get("kwargs")})
            runner.send(0, test.forwardable(raw, "call"))
        # anything else is not a request this test can make: not made


def _run_one(test, spec):
    """Run one test; return (passed, why)."""
    return _run_stdio(test, spec) if spec["kind"] == "stdio" else _run_call(test, spec)


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
    except RunnerError:
        raise
    except BaseException as e:  # the writer's own code failed on this test: never a pass
        ok, why = False, "judge_error:" + type(e).__name__
    finally:  # disarmed by now (by _guarded, or by the one Deadline itself): the kill is not interrupted
        if test.runner is not None:
            test.runner.kill()
    if test.failed:  # a failed call fails the test whatever its runner reported
        return False, test.failed
    return ok, why


_ARMED = [None]  # the test whose deadline SIGALRM enforces now (None: the alarm is ignored)


def _alarm(*_):
    """The test's time is up: fail it and raise Deadline, once per arming (the writer's own code catches it
    in _verdict only; test code, which runs in the runner, never sees it)."""
    test = _ARMED[0]
    if test is not None:
        _ARMED[0] = None
        test.failed = test.failed or "timeout"
        raise Deadline()


def judge_sample(job, chan, out):
    """Run every test of one sample in order, each within its own deadline and the sample's total. The
    sample's clock starts when the harness says it is ready (its start-up has the parent's margin); the
    first test is sent before that, so the sandbox starts it at once, and its alarm is re-armed then.
    Writes ``{"pid"}``, one verdict per test in order, then ``{"done": 1}``; ``{"error"}`` instead when a
    runner cannot be started or confined (an infrastructure failure)."""
    out.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    signal.signal(signal.SIGALRM, _alarm)
    ch = _Chan(chan, record_cap(job["max_output_bytes"]),
               {"uid": job.get("uid"), "memory_bytes": job.get("memory_bytes")})
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
        budget = max(budget, MIN_BUDGET_S)  # started ahead: the harness answered, or answers that time is up
        test = _Test(ch)
        # before the harness is ready: a generous alarm, re-armed with the real budget at ready
        signal.setitimer(signal.ITIMER_REAL, budget if ch.end is not None else budget + ch.total, 0.05)
        try:
            ok, why = _verdict(test, dict(spec, i=i, budget=budget))
        except RunnerError as e:
            out.sendall(json.dumps({"error": str(e)[:300]}).encode() + b"\n")
            return
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


def _start_runners():
    """Fork the zygote (before any sample); the writers ask it for runners over a SOCK_SEQPACKET pair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = FORK()
    if pid == 0:
        zygote(theirs)
    theirs.close()
    _RUNNERS["zygote"] = ours
    return pid


def main():
    """Wait for samples on the control socket; fork one child per sample."""
    non_dumpable()  # a same-uid candidate (rlimits mode without root) cannot ptrace or read us
    ctl = socket.socket(fileno=int(sys.argv[1]))
    for m in PARENT_MODULES:  # imported once here, inherited by every sample's child and every runner
        importlib.import_module(m)
    zygote = _start_runners()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    # What exists now is never collected: the children's garbage collector then does not walk (and so
    # copy, page by page) the memory they share with us.
    gc.collect()
    gc.freeze()
    try:
        _serve(ctl)
    finally:
        _RUNNERS["zygote"].close()
        _RUNNERS["zygote"] = None
        try:
            os.waitpid(zygote, 0)
        except ChildProcessError:  # reaped by the kernel already
            pass


def _serve(ctl):
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
