"""The judge's test runner: one test's code, run in a confined process of its own (shared source).

The judge (``_judge.py``) holds the verdicts and the channel to the sandbox's harness, and never runs test
code. For each call test it has a runner started (forked from the judge's zygote, which never held a
sample, so a runner's memory holds its own test and nothing else); the runner confines itself before it
reads the test (``_jail.confine``: the jail tree as its root, the sample's sandbox uid, no capabilities, no
new process, no file writes, an address-space cap), then runs the test code with the judge's builtins and
binds each name the test needs from the candidate to what the candidate reports: a plain value, or a
proxy that asks the judge to make the call and gets the harness's answer line back. It interprets answers
(``interpret``: plain data only, anything else a failed call) and ends with one verdict message. Test code
that evaluates what the candidate returns (``eval(expr(1, 2))``) thus runs with no more authority than the
candidate, and what it can forge is its own test's verdict, nothing else.

Runner to judge, one JSON line each: ``{"op": "resolve"}``, ``{"op": "call", "name", "args", "kwargs"}``
(arguments as plain data), ``{"verdict": [ok, why]}``. Judge to runner: the test (a frame of JSON), then
one frame per request: ``<h> <length>\\n`` then the answer line's body, ``h`` 1 when it is the harness's own
record. The judge's *zygote* (``zygote``) is here too: forked by the judge before any sample, it sets the jail up
and forks one runner per writer's request, and SIGKILLs a runner that outlives its budget by
``RUNNER_MARGIN_S`` (a runner asleep in test code uses no CPU time). Standard library only; this source
follows ``_plain.py`` and ``_jail.py`` in the judge.
"""
import builtins
import importlib
import json
import os
import select
import signal
import socket
import time

try:  # run, this file comes after _plain.py's and _jail.py's sources; imported, it imports them
    plain_encode  # noqa: B018
except NameError:
    from rewards._jail import confine, enter_user_namespace, non_dumpable
    from rewards._jail import setup as jail_setup
    from rewards._plain import PlainError, plain_decode, plain_encode
else:
    jail_setup = setup  # noqa: F821 - _jail.py's, in the concatenated source

PARENT_MODULES = ("math", "cmath", "re", "string", "itertools", "functools", "collections", "heapq",
                   "bisect", "fractions", "decimal", "statistics", "operator")
# Exceptions the interpreter itself reads as "the iteration is over": raised by the candidate inside
# test code they would end an enclosing ``for ... in map(f, ...)`` or ``all(map(...))`` silently, so the
# test would pass without checking anything (PEP 479's reason). The candidate's raising one is a failed call.
ITERATION_ENDS = ("StopIteration", "StopAsyncIteration")
# What the harness itself reports about a call (its own records, never the candidate's)
HARNESS_WHY = ("timeout", "died", "output_limit")
# Every outcome a verdict may name, besides raised:<identifier> and assert_raised:<identifier>
WHY_WORDS = ("ok", "assert_failed", "bad_record", "bad_value", "bad_argument", "test_died") + HARNESS_WHY
FORK, EXIT = os.fork, os._exit  # taken at import: tests replace os.fork / os._exit around the judge's main


class CallFailed(BaseException):
    """A call the candidate did not answer with plain data (BaseException: ``except Exception`` in test
    code does not swallow it)."""


def valid_why(why):
    """True when ``why`` is an outcome word: one of WHY_WORDS, or ``raised:``/``assert_raised:`` and an
    ASCII identifier, 60 characters in all at most."""
    if type(why) is not str or len(why) > 60:
        return False
    if why in WHY_WORDS:
        return True
    name = why.partition(":")[2]
    return why.startswith(("raised:", "assert_raised:")) and name.isascii() and name.isidentifier()


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
        if msg.get("h") in HARNESS_WHY:
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
        if name in ITERATION_ENDS:
            return test.fail("raised:" + name)
        if expect == "call" and isinstance(cls, type) and issubclass(cls, Exception):
            raise cls("raised by the candidate")  # test code may expect it (``except ValueError``)
        return test.fail("raised:" + name)
    if "bad" in msg and len(msg) == 1:
        return test.fail("bad_value")
    return test.fail("bad_record")  # anything else: a failed call, never a pass


def read_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def read_frame(sock):
    """(flag, body) of one frame ``<flag> <length>\\n<body>``."""
    head = b""
    while not head.endswith(b"\n"):
        c = sock.recv(1)
        if not c or len(head) > 40:
            raise EOFError
        head += c
    flag, n = head.split()
    return int(flag), read_exact(sock, int(n))


class RunnerTest:
    """The runner's side of one test: what went wrong, the candidate's last exception, and the judge."""

    def __init__(self, sock):
        self.sock = sock
        self.failed = None   # why a call failed: the test fails whatever the test code does after it
        self.raised = None   # type name of the candidate's last exception

    def ask(self, msg, expect):
        """Ask the judge (``resolve``, or a call it makes for us); the answer, interpreted here."""
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        try:
            harness, body = read_frame(self.sock)
        except (EOFError, OSError, ValueError):
            return self.fail("died")
        return interpret(body, self, expect, harness=bool(harness))

    def fail(self, why):
        self.failed = self.failed or why
        raise CallFailed(why)


def _proxy(test, name):
    def call(*args, **kwargs):
        try:
            a, k = plain_encode(list(args)), plain_encode(dict(kwargs))
        except PlainError:
            return test.fail("bad_argument")
        return test.ask({"op": "call", "name": name, "args": a, "kwargs": k}, "call")
    call.__name__ = call.__qualname__ = name
    return call


def _bind(test, spec, scope):
    """Bind each name the test needs to what the candidate reports."""
    kinds = test.ask({"op": "resolve"}, "resolve")
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


_CODE = {}


def compiled_test(src, label):
    """Compiled once per source in this process."""
    if src not in _CODE:
        _CODE[src] = compile(src, label, "exec")
    return _CODE[src]


def run_test_code(test, spec):
    """Run one call test's code; return (passed, why)."""
    try:
        scope = {"__name__": "__judge__", "__builtins__": builtins}
        for m in PARENT_MODULES:
            scope[m] = importlib.import_module(m)
        if spec.get("prelude"):  # helpers the task's prompt defines: trusted task code
            exec(compiled_test(spec["prelude"], "<prompt helpers>"), scope)
        _bind(test, spec, scope)
        exec(compile(spec["src"], "<test %d>" % spec["i"], "exec"), scope)
        ok, why = True, "ok"
    except CallFailed as e:
        ok, why = False, str(e)
    except AssertionError:
        ok, why = False, "raised:" + test.raised if test.raised else "assert_failed"
    except BaseException as e:  # the test code's own error, or one the candidate's exception caused
        ok, why = False, "raised:" + test.raised if test.raised else "assert_raised:" + type(e).__name__
    if test.failed:  # a failed call fails the test even when the test code caught it
        return False, test.failed
    return ok, why


def runner_main(sock, root, uid, memory_bytes, cpu_s):
    """A runner's life: say its pid, confine itself, read its test, run it, send the verdict, exit. Never
    returns. ``root``/``uid``: the jail tree and the sample's sandbox uid (None: stay)."""
    code = 0
    try:
        sock.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        try:
            confine(root, uid, {sock.fileno()}, memory_bytes, cpu_s)
        except BaseException as e:  # not confined: the test is never read
            sock.sendall(json.dumps({"confine_failed": "%s: %s" % (type(e).__name__, e)}).encode() + b"\n")
            EXIT(3)
        sock.sendall(b'{"confined": 1}\n')
        spec = json.loads(read_frame(sock)[1])
        ok, why = run_test_code(RunnerTest(sock), spec)
        sock.sendall(json.dumps({"verdict": [bool(ok), str(why)[:60]]}).encode() + b"\n")
    except BaseException:
        code = 1
    EXIT(code)


def zygote(zsock):
    """The runners' parent, forked from the judge before any sample (its memory holds none): set the jail
    up, then fork one runner per request (a JSON config and the runner's socket). Ends when every writer
    and the judge have closed their end."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    non_dumpable()
    # what the judge held (its control socket; its end of ours, which may be descriptor 0 since the judge
    # closed its stdin) is not ours to keep: we end when every holder of that end has closed it
    null = os.open(os.devnull, os.O_RDWR)
    for fd in [int(fd) for fd in os.listdir("/proc/self/fd")]:
        if fd != zsock.fileno() and fd != null:
            try:
                if fd <= 2:
                    os.dup2(null, fd)
                else:
                    os.close(fd)
            except OSError:
                pass
    os.close(null)
    if os.geteuid() != 0:
        try:
            enter_user_namespace()
        except OSError:
            pass
    mode, root = jail_setup()
    lives = {}  # pidfd of a runner -> when it is killed whatever it does (its writer kills it long before)
    zsock.settimeout(1.0)
    while True:
        _end_overdue(lives)
        try:
            msg, fds, _, _ = socket.recv_fds(zsock, 4096, 1)
        except TimeoutError:
            continue
        except OSError:
            break
        if not msg:
            break
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        cfg = json.loads(msg)
        pid = FORK()
        if pid == 0:
            zsock.close()
            runner_main(socket.socket(fileno=fds[0]), root, cfg["uid"], cfg["memory_bytes"], cfg["cpu_s"])
        os.close(fds[0])
        try:
            lives[os.pidfd_open(pid)] = time.monotonic() + cfg["cpu_s"] + RUNNER_MARGIN_S
        except OSError:  # gone already
            pass
    if mode == "chroot":
        try:
            os.rmdir(root)
        except OSError:
            pass
    EXIT(0)


RUNNER_MARGIN_S = 10.0  # a runner outlives its test's budget by at most this (its writer was killed)


def _end_overdue(lives):
    """Forget runners that have exited; SIGKILL those past their lifetime (a runner sleeping in test code
    whose writer was killed uses no CPU time, so its RLIMIT_CPU would never end it)."""
    now = time.monotonic()
    done = set(select.select(list(lives), [], [], 0)[0]) if lives else set()
    for fd, end in list(lives.items()):
        if fd not in done and now >= end:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            done.add(fd)
        if fd in done:
            os.close(fd)
            del lives[fd]
