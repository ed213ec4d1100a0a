"""What the judge makes of the output: a harness line is read whole up to its bound (rewards/_judge.py, driven in
this process through socket pairs by a small harness that speaks the channel protocol of rewards/_harness.py's
docstring), and what happens after a cut; stdin/stdout tests compare the output exactly as documented
(rewards/code_tests.py): line endings and trailing whitespace (of each line, and trailing blank lines) are
normalised, nothing else: leading whitespace, inner blank lines and every other character count."""
import json
import random
import signal
import socket
import threading

from rewards import _judge as J
from rewards.code_reward import code_reward


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


OUT = "  12 ab\n\tx  y\n\n   \nlast line\n"  # what the candidate prints: leading blanks, an inner blank line


def _lines(text):
    """The documented comparison, read literally: lines (any line ending) without trailing blanks, and no
    trailing blank lines."""
    lines = [ln.rstrip(" \t\f\v") for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _variants(rng):
    """Expected outputs derived from OUT by edits the rule normalises and edits it does not."""
    lines = OUT.split("\n")
    same, differ = [], []
    for _ in range(6):
        ls = list(lines)
        i = rng.randrange(len(ls))
        ls[i] = ls[i] + rng.choice([" ", "\t", "  \t"])  # trailing whitespace on a line
        same.append("\n".join(ls))
    same += [OUT.replace("\n", "\r\n"), OUT.replace("\n", "\r"), OUT.rstrip("\n"), OUT + "\n\n  \n", OUT.rstrip()]
    text_lines = [i for i, ln in enumerate(lines) if ln.strip()]
    for i in text_lines:
        ls = list(lines)
        ls[i] = " " + ls[i]  # one more leading blank
        differ.append("\n".join(ls))
        if ls[i][1] in " \t":
            ls = list(lines)
            ls[i] = ls[i][1:]  # one leading blank fewer
            differ.append("\n".join(ls))
    differ += [OUT.replace("\n\n", "\n", 1),  # the inner blank line dropped
               OUT.replace("ab", "a b"), OUT.replace("x  y", "x y"), "\n" + OUT, OUT.replace("\t", "    ", 1)]
    return same, differ


def test_stdio_output_is_compared_as_documented_leading_whitespace_matters():
    rng = random.Random(40)
    same, differ = _variants(rng)
    for e in same:
        assert _lines(e) == _lines(OUT), repr(e)
    for e in differ:
        assert _lines(e) != _lines(OUT), repr(e)
    prog = f"import sys\nsys.stdout.write({OUT!r})\n"
    tests = [{"input": "", "output": e} for e in same + differ]
    out = code_reward(completion=prog, tests=tests, sandbox="rlimits", test_timeout_s=5.0, total_timeout_s=60.0)
    want = ["ok"] * len(same) + ["wrong_output"] * len(differ)
    assert out.extras["outcomes"] == want, [(t["output"], o) for t, o in zip(tests, out.extras["outcomes"])
                                             if (o == "ok") != (t["output"] in same)]
