"""The harness's side of the judge's channel, in this process: `judge(tests, ...)` runs rewards/_judge.py's
`judge_sample` against a plain in-test `Harness` that speaks the documented channel protocol (rewards/_harness.py's
docstring), with the candidate as Python objects. Tests that break one rule of the protocol on purpose replace
`Harness` in this module (monkeypatch) with a subclass."""
import json
import signal
import socket
import threading
import time

from rewards import _judge as J
from rewards._plain import plain_decode, plain_encode


class Harness(threading.Thread):
    """The harness's side of the channel, as its docstring specifies, with the candidate as Python objects:
    `names` (name -> value or callable) for call tests, `program(stdin) -> (stdout, exit, status)` for stdio
    tests. `delay(msg)` seconds before answering a request; `ready_after` seconds before the ready record."""

    def __init__(self, sock, names=None, program=None, delay=lambda msg: 0.0, ready_after=0.0, raw=None):
        super().__init__(daemon=True)
        self.sock, self.names, self.program = sock, names or {}, program
        self.delay, self.ready_after, self.raw = delay, ready_after, raw
        self.received = []

    def run(self):
        time.sleep(self.ready_after)
        self.sock.sendall(b'0h {"ready": 1}\n')
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    self.received.append(msg)
                    if msg["op"] == "bye":
                        return
                    self.answer(msg)
        except OSError:
            return

    def answer(self, msg):
        time.sleep(self.delay(msg))
        if self.raw is not None:  # a line of the test's own choosing for every request
            self.sock.sendall(self.raw(msg))
            return
        if msg["op"] == "start" and msg["kind"] == "stdio":
            out, code, status = self.program(msg["stdin"])
            self.sock.sendall(b"%dh " % msg["seq"] + json.dumps({"stdout": out, "exit": code, "status": status}
                                                                 ).encode() + b"\n")
            return
        if msg["op"] == "start":
            kinds = {n: ["fn"] if callable(self.names[n]) else ["v", plain_encode(self.names[n])]
                     for n in msg["names"] if n in self.names}
            self.line(msg["seq"], {"names": kinds})
            if "first" in msg:
                self.call(msg["first"])
        else:
            self.call(msg)

    def call(self, msg):
        try:
            v = self.names[msg["name"]](*plain_decode(msg["args"]), **plain_decode(msg["kwargs"]))
        except Exception as e:
            return self.line(msg["seq"], {"raised": type(e).__name__})
        self.line(msg["seq"], {"v": plain_encode(v)})

    def line(self, seq, obj):
        self.sock.sendall(b"%d " % seq + json.dumps(obj).encode() + b"\n")


def judge(tests, test_timeout=2.0, total=10.0, max_output=1 << 16, **harness):
    """Verdict records of judge_sample for `tests`, run here against a Harness; (records, harness)."""
    chan_j, chan_h = socket.socketpair()
    out_j, out_r = socket.socketpair()
    h = Harness(chan_h, **harness)
    h.start()
    job = {"tests": tests, "max_output_bytes": max_output, "total_timeout_s": total, "test_timeout_s": test_timeout}
    old = signal.getsignal(signal.SIGALRM)
    try:
        J.judge_sample(job, chan_j, out_j)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        chan_j.close()
        out_j.close()
    h.join(5)
    data = b""
    while chunk := out_r.recv(1 << 16):
        data += chunk
    out_r.close()
    chan_h.close()
    recs = [json.loads(ln) for ln in data.splitlines()]
    assert recs[0] == {"pid": __import__("os").getpid()} and recs[-1] == {"done": 1}
    return recs[1:-1], h


def _call_spec(names, first=None, src="pass"):
    s = {"kind": "call", "src": src, "names": names}
    if first:
        s["first"] = {"name": first, "args": plain_encode([1]), "kwargs": plain_encode({})}
    return s


def _v(recs):
    return [(r["ok"], r["why"]) for r in recs]
