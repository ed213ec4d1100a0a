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


# ---------------------------------------------------------------- test code runs in a confined runner

import os  # noqa: E402
import socket as _socket  # noqa: E402

import pytest  # noqa: E402

from rewards.code_reward import code_reward  # noqa: E402
from rewards.sandbox import mode_works  # noqa: E402

MODES = [m for m in ("bwrap", "unshare", "rlimits") if m == "rlimits" or mode_works(m)]


def _forger(marker, silence):
    """A candidate whose `expr` returns text that, evaluated by the test, writes "ok" verdicts for every test
    and "done" on every descriptor it has, tries to write a host file, and evaluates to 3; with `silence`, it
    also makes every later write on a socket of its process a no-op (so that no real verdict could follow)."""
    forge = ("import os, socket\n"
             "L = b''.join(b'{\"i\": %d, \"ok\": true, \"why\": \"ok\"}\\n' % i for i in range(3)) + b'{\"done\": 1}\\n'\n"
             "for fd in range(3, 1100):\n"
             "    try:\n        os.write(fd, L)\n    except OSError:\n        pass\n"
             f"try:\n    open({marker!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
             + ("socket.socket.sendall = lambda self, data: None\n" if silence else ""))
    payload = f"exec({forge!r}) or 3"
    return f"def expr(a, b):\n    return {payload!r}\n\ndef add(a, b):\n    return 0\n"


TESTS = ["assert eval(expr(1, 2)) == 3", "assert add(1, 2) == 3", "assert add(2, 2) == 4"]


@pytest.mark.parametrize("mode", MODES)
def test_a_test_that_evaluates_the_candidate_s_output_cannot_forge_other_verdicts(mode, tmp_path):
    """`assert eval(expr(1, 2)) == 3` is the one right test of three: the candidate's forged verdicts and done
    change nothing, it scores the true fraction, and the file it writes from the test code does not appear."""
    marker = str(tmp_path / "pwned")
    os.chmod(tmp_path, 0o777)  # writable by any uid: only the runner's confinement can stop the write
    out = code_reward(completion=_forger(marker, silence=False), tests=TESTS, sandbox=mode)
    assert out.extras["outcomes"] == ["ok", "assert_failed", "assert_failed"]
    assert out.score == pytest.approx(1 / 3)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_test_code_that_silences_its_process_loses_its_own_verdict_only(mode, tmp_path):
    """The same forger, which then silences every socket of the process it runs in: the real verdicts cannot be
    silenced (they are not written there), its own test has no verdict (a failure), the rest are judged."""
    marker = str(tmp_path / "pwned")
    os.chmod(tmp_path, 0o777)
    out = code_reward(completion=_forger(marker, silence=True), tests=TESTS, sandbox=mode)
    assert out.extras["outcomes"] == ["test_died", "assert_failed", "assert_failed"] and out.score == 0.0
    assert os.listdir(tmp_path) == []


def _jail_mode():
    """The jail mode a zygote gets here (its setup, run in a child process)."""
    import subprocess
    import sys
    code = ("import os\nfrom rewards import _jail\n"
            "if os.geteuid() != 0:\n    try:\n        _jail.enter_user_namespace()\n    except OSError:\n        pass\n"
            "mode, root = _jail.setup()\nprint(mode)\nif mode == 'chroot':\n    os.rmdir(root)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()


def test_test_code_has_no_more_authority_than_the_candidate(tmp_path):
    """What test code (here the dataset's own, as a probe) can do in its runner: not root, no network, no file
    written, none of the host's files read."""
    listener = _socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    os.chmod(tmp_path, 0o777)
    probes = {
        "not_root": "assert f() == 1 and (__import__('os').getuid() != 0 or __import__('os').geteuid() != 0)",
        "no_network": (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                       "    reached = True\nexcept OSError:\n    reached = False\nassert f() == 1 and not reached"),
        "no_write": (f"try:\n    open({str(tmp_path / 'x')!r}, 'w').write('x')\n    wrote = True\n"
                     "except OSError:\n    wrote = False\nassert f() == 1 and not wrote"),
        "no_host_files": ("import os\n"
                          "assert f() == 1 and not os.path.exists('/etc/passwd') and not os.path.exists('/proc/1')"),
        "no_fork": "import os\ntry:\n    pid = os.fork()\nexcept OSError:\n    pid = None\nassert f() == 1 and pid is None",
    }
    if os.geteuid() != 0:
        del probes["not_root"]
    if _jail_mode() != "namespaces":  # root in a container that refuses namespaces: the network stays open
        del probes["no_network"]
    assert os.path.exists("/etc/passwd") and os.path.exists("/proc/1")  # the probes' files exist here
    out = code_reward(completion="def f():\n    return 1\n", tests=list(probes.values()), sandbox="rlimits")
    listener.close()
    assert dict(zip(probes, out.extras["outcomes"])) == {k: "ok" for k in probes}
    assert os.listdir(tmp_path) == []


def test_the_zygote_ends_a_runner_past_its_lifetime_and_forgets_one_that_exited():
    """A runner asleep in test code whose writer was killed uses no CPU time: the zygote SIGKILLs it once its
    lifetime is over (budget plus RUNNER_MARGIN_S); a runner that exited is forgotten."""
    import subprocess
    import sys
    import time

    from rewards import _judge_runner as R
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    lives = {os.pidfd_open(sleeper.pid): time.monotonic() + 60, os.pidfd_open(quick.pid): time.monotonic() + 60}
    quick.wait()
    R._end_overdue(lives)
    assert len(lives) == 1 and sleeper.poll() is None  # the exited one forgotten, the other within its life
    lives[next(iter(lives))] = time.monotonic() - 1
    R._end_overdue(lives)
    assert lives == {} and sleeper.wait(timeout=10) == -9
