"""`main` of rewards/_judge.py, and `_recv_exact` that reads its messages, run in this process.

The first test of `main` forks the judge's child for real, which a mutation tool's worker cannot survive, so
it is skipped there. The others drive the same `main` over a socket pair with `os.fork` replaced:
returning a pid, main takes the parent's side (closes the sample's descriptors and waits for the next one);
returning 0, it takes the child's side in this process, with `os._exit` turned into an exception carrying the
exit code and `resource.setrlimit` recorded instead of applied to the test process.

Rules (from main's docstring and the protocol rewards/judge.py speaks):
* the parent makes itself non-dumpable, lets the kernel reap the children (SIGCHLD ignored) and freezes its heap;
* a message is a 10-digit length, then that many bytes of JSON job, with exactly two descriptors (the sample's
  channel, its verdict socket); the length may arrive in pieces, or together with the job; a message with fewer
  descriptors is skipped and the ones it carried closed; EOF or a broken message on the control socket ends main;
* per sample one fork: the parent closes its copies of the two descriptors; the child closes the control
  socket, restores SIGCHLD, caps its address space at the job's `memory_bytes` (when given), judges the sample
  on the two descriptors and exits 0, or 1 when judging raised.
"""
import ctypes
import gc
import json
import resource
import signal
import socket
import sys
import threading

import pytest

from rewards import _judge as J
from rewards._plain import plain_decode, plain_encode
from tests.rewards.judge.channel import Harness, _call_spec

PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4

def test_recv_exact_reads_exactly_n_bytes_across_pieces_or_raises_at_eof():
    a, b = socket.socketpair()
    try:
        a.sendall(b"0123")
        threading.Timer(0.05, lambda: a.sendall(b"456789XY")).start()
        assert J._recv_exact(b, 10) == b"0123456789"
        assert J._recv_exact(b, 0) == b"" and J._recv_exact(b, 2) == b"XY"
        a.sendall(b"abc")
        a.close()
        with pytest.raises(EOFError):
            J._recv_exact(b, 4)
    finally:
        b.close()


@pytest.mark.skipif("MUTANT_UNDER_TEST" in __import__("os").environ,
                    reason="forks inside a mutmut worker, whose process bookkeeping then fails (KeyError on the pid)")
def test_main_forks_one_judge_per_sample_and_returns_when_the_parent_closes(monkeypatch):
    """main() as rewards/judge.py drives it: a length-prefixed job with two descriptors per sample (a message
    with another number of descriptors is skipped, its descriptors closed); each sample is judged in a child
    whose verdicts come back on the sample's socket; EOF on the control socket ends main. Run here so that a
    mutation tool sees it; the process state it changes (SIGCHLD, dumpable, the frozen heap) is restored."""
    import ctypes
    import gc
    import sys
    ctl_ours, ctl_judge = socket.socketpair()
    monkeypatch.setattr(sys, "argv", ["judge", str(ctl_judge.fileno())])
    old_chld = signal.getsignal(signal.SIGCHLD)
    results, harnesses = [], []

    def parent():
        try:
            lone, _ = socket.socketpair()
            socket.send_fds(ctl_ours, [b"%010d" % 2], [lone.fileno()])  # one descriptor: skipped
            ctl_ours.sendall(b"{}")
            lone.close()
            for k in range(2):
                chan_j, chan_h = socket.socketpair()
                out_j, out_r = socket.socketpair()
                h = Harness(chan_h, names={"f": lambda x: x + 1})
                h.start()
                harnesses.append(h)
                job = {"tests": [_call_spec(["f"], src=f"assert f({k}) == {k + 1}"),
                                 _call_spec(["f"], src=f"assert f({k}) == {k}")],
                       "max_output_bytes": 4096, "total_timeout_s": 5.0, "test_timeout_s": 2.0}
                body = json.dumps(job).encode()
                socket.send_fds(ctl_ours, [b"%010d" % len(body)], [chan_j.fileno(), out_j.fileno()])
                ctl_ours.sendall(body)
                chan_j.close()
                out_j.close()
                data = b""
                out_r.settimeout(20)
                while chunk := out_r.recv(1 << 16):
                    data += chunk
                results.append([json.loads(ln) for ln in data.splitlines()])
                out_r.close()
        finally:
            ctl_ours.close()  # EOF: main returns

    t = threading.Thread(target=parent, daemon=True)
    t.start()
    try:
        J.main()
    finally:
        signal.signal(signal.SIGCHLD, old_chld)
        gc.unfreeze()
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again
    t.join(30)
    assert len(results) == 2
    for recs in results:
        pid = recs[0]["pid"]
        assert pid != __import__("os").getpid()  # judged in a child
        assert [(r["ok"], r["why"]) for r in recs[1:-1]] == [(True, "ok"), (False, "assert_failed")]
        assert recs[-1] == {"done": 1}
    assert results[0][0]["pid"] != results[1][0]["pid"]  # a fresh child per sample


class _Exit(BaseException):
    """os._exit(code) of the judge's child, here an exception (BaseException: main's handlers do not take it)."""

    def __init__(self, code, sigchld):
        super().__init__(code)
        self.code, self.sigchld = code, sigchld


@pytest.fixture
def judge_main(monkeypatch):
    """A control socket pair with the judge's end named in argv; the process state main changes restored."""
    ours, theirs = socket.socketpair()
    # non-blocking: a main that waits for one message more than the test sent gets EAGAIN (an OSError, which
    # ends it) instead of hanging; everything the test sends is queued before main starts
    theirs.setblocking(False)
    monkeypatch.setattr(sys, "argv", ["judge", str(theirs.detach())])  # main owns (and closes) that end
    old = {s: signal.getsignal(s) for s in (signal.SIGCHLD, signal.SIGALRM)}
    limits = []
    monkeypatch.setattr(J.resource, "setrlimit", lambda which, lim: limits.append((which, lim)))

    def fake_exit(code):
        raise _Exit(code, signal.getsignal(signal.SIGCHLD))

    monkeypatch.setattr(J.os, "_exit", fake_exit)
    try:
        yield ours, limits
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in old.items():
            signal.signal(s, h)
        gc.unfreeze()
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        ours.close()


def _forks(monkeypatch, pid):
    calls = []

    def fork():
        calls.append(pid)
        return pid

    monkeypatch.setattr(J.os, "fork", fork)
    return calls


def _closed_by_peer(sock):
    """True when the other end of `sock` is closed (EOF now), False when it is open and silent."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False


def test_parent_forks_once_per_sample_closes_its_descriptors_and_stops_at_eof(judge_main, monkeypatch):
    ctl, _ = judge_main
    forks = _forks(monkeypatch, 4242)
    body = json.dumps({"tests": []}).encode()
    head = b"%010d" % len(body)
    peers = []

    def pair():
        a, b = socket.socketpair()
        peers.append(b)
        return a

    lone = pair()  # one descriptor: skipped, closed
    socket.send_fds(ctl, [head + body], [lone.fileno()])
    socket.send_fds(ctl, [head + body], [])  # none: skipped
    for split in (10, 4, 1):  # the length whole with the job, or in pieces (the rest comes with the job)
        a, b = pair(), pair()
        socket.send_fds(ctl, [head[:split] if split < 10 else head + body], [a.fileno(), b.fileno()])
        if split < 10:
            ctl.sendall(head[split:] + body)
        a.close()
        b.close()
    lone.close()
    ctl.shutdown(socket.SHUT_WR)  # EOF: main returns
    J.main()
    assert forks == [4242] * 3  # one per sample with two descriptors, none for the others
    assert all(_closed_by_peer(p) for p in peers)  # main kept no copy of any descriptor it received
    assert ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN
    assert gc.get_freeze_count() > 0


@pytest.mark.parametrize("broken", [b"12345abcde{}", b"0000000009{}"])  # not a number; a job cut short (EOF)
def test_a_broken_message_ends_main(judge_main, monkeypatch, broken):
    ctl, _ = judge_main
    forks = _forks(monkeypatch, 4242)
    a, b = socket.socketpair()
    socket.send_fds(ctl, [broken], [a.fileno(), b.fileno()])
    ctl.shutdown(socket.SHUT_WR)
    J.main()
    a.close()
    b.close()
    assert forks == []


def _harness(sock, names):
    """The harness's side of one call-test sample (see rewards/_harness.py): ready, resolve, calls, bye."""
    def run():
        sock.sendall(b'0h {"ready": 1}\n')
        buf = b""
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg["op"] == "bye":
                    return
                if msg["op"] == "start":
                    kinds = {n: ["fn"] for n in msg["names"] if n in names}
                    sock.sendall(b"%d " % msg["seq"] + json.dumps({"names": kinds}).encode() + b"\n")
                else:
                    v = names[msg["name"]](*plain_decode(msg["args"]), **plain_decode(msg["kwargs"]))
                    sock.sendall(b"%d " % msg["seq"] + json.dumps({"v": plain_encode(v)}).encode() + b"\n")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _records(sock, until=b'{"done": 1}\n'):
    """Verdict lines up to and including `until` (or EOF)."""
    sock.settimeout(30)
    data = b""
    while until not in data and (chunk := sock.recv(1 << 16)):
        data += chunk
    return [json.loads(ln) for ln in data.splitlines()]


@pytest.mark.parametrize("memory", [3 << 30, None])
def test_child_judges_the_sample_on_its_two_descriptors_and_exits_0(judge_main, monkeypatch, memory):
    ctl, limits = judge_main
    forks = _forks(monkeypatch, 0)
    chan_j, chan_h = socket.socketpair()
    out_j, out_r = socket.socketpair()
    job = {"tests": [{"kind": "call", "src": "assert f(2) == 3", "names": ["f"]},
                     {"kind": "call", "src": "assert f(2) == 4", "names": ["f"]}],
           "max_output_bytes": 4096, "total_timeout_s": 5.0, "test_timeout_s": 2.0}
    if memory:
        job["memory_bytes"] = memory
    body = json.dumps(job).encode()
    socket.send_fds(ctl, [b"%010d" % len(body)], [chan_j.fileno(), out_j.fileno()])  # as rewards/judge.py sends
    ctl.sendall(body)
    chan_j.close()
    out_j.close()
    h = _harness(chan_h, {"f": lambda x: x + 1})
    with pytest.raises(_Exit) as ex:
        J.main()
    assert ex.value.code == 0 and forks == [0]
    assert ex.value.sigchld == signal.SIG_DFL  # the child's own children are its to reap
    assert _closed_by_peer(ctl)  # the child keeps no control socket
    assert limits == ([(resource.RLIMIT_AS, (memory, memory))] if memory else [])
    recs = _records(out_r)
    assert recs[0] == {"pid": __import__("os").getpid()} and recs[-1] == {"done": 1}
    assert [(r["i"], r["ok"], r["why"]) for r in recs[1:-1]] == [(0, True, "ok"), (1, False, "assert_failed")]
    h.join(10)
    chan_h.close()
    out_r.close()


def test_child_exits_1_when_judging_raises(judge_main, monkeypatch):
    ctl, limits = judge_main
    _forks(monkeypatch, 0)
    chan_j, chan_h = socket.socketpair()
    out_j, out_r = socket.socketpair()
    body = json.dumps({"max_output_bytes": 4096}).encode()  # no tests, no timeouts: judge_sample raises
    socket.send_fds(ctl, [b"%010d" % len(body) + body], [chan_j.fileno(), out_j.fileno()])
    chan_j.close()
    out_j.close()
    with pytest.raises(_Exit) as ex:
        J.main()
    assert ex.value.code == 1 and limits == []
    assert _records(out_r, until=b"\n")[0] == {"pid": __import__("os").getpid()}  # it got as far as the verdict socket
    chan_h.close()
    out_r.close()
