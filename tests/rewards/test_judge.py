"""rewards/_judge.py, driven in this process through socket pairs by a small harness that speaks the channel
protocol (rewards/_harness.py's docstring): the bound on a harness line and what happens after a cut."""
import json
import signal
import socket
import threading

from rewards import _judge as J


class _Harness(threading.Thread):
    """Answers each stdio start with `records[i]` (raw bytes after `<seq>h `), written in 64 kB pieces."""

    def __init__(self, sock, records):
        super().__init__(daemon=True)
        self.sock, self.records, self.i = sock, list(records), 0

    def run(self):
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
                    if msg["op"] == "bye":
                        return
                    data = b"%dh " % msg["seq"] + self.records[msg["i"]] + b"\n"
                    for k in range(0, len(data), 1 << 16):
                        self.sock.sendall(data[k:k + (1 << 16)])
        except OSError:
            return


def _judge_stdio(records, expected, max_output):
    chan_j, chan_h = socket.socketpair()
    out_j, out_r = socket.socketpair()
    h = _Harness(chan_h, records)
    h.start()
    tests = [{"kind": "stdio", "stdin": "", "expected": e} for e in expected]
    job = {"tests": tests, "max_output_bytes": max_output, "total_timeout_s": 20.0, "test_timeout_s": 10.0}
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
    recs = [json.loads(ln) for ln in data.splitlines()][1:-1]
    return [(r["ok"], r["why"]) for r in recs]


def _record(stdout):
    return json.dumps({"stdout": stdout, "exit": 0, "status": "ok"}).encode()


def test_a_record_of_escaped_output_within_the_bound_is_read_whole():
    bound = 200_000  # the record (1.2 MB) comes in several pieces
    worst = "\x01" * bound  # 6 bytes each once escaped: the record is over 6x the bound
    assert len(_record(worst)) > 6 * bound
    assert _judge_stdio([_record(worst), _record("b")], [worst, "b"], bound) == [(True, "ok"), (True, "ok")]


def test_after_a_cut_the_rest_of_the_line_is_skipped_and_the_next_test_reads_its_own():
    bound = 1000
    too_long = _record("a" * (8 * (6 * bound + 4096)))  # several caps: its tail would be read as more lines
    got = _judge_stdio([too_long, _record("b"), _record("c")], ["a", "b", "c"], bound)
    assert got == [(False, "output_limit"), (True, "ok"), (True, "ok")]
    # the same, with the whole line in one piece: the bound does not depend on how the line arrives
    got = _judge_stdio([_record("a" * (6 * bound + 4096)), _record("b")], ["a", "b"], bound)
    assert got == [(False, "output_limit"), (True, "ok")]
