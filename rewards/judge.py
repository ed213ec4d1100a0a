"""The parent's side of the judge: one long-lived judge process per reward process, one fork per sample.

The judge (``_judge.py``) runs outside the sandbox, under this process's uid, with this process's
interpreter; the test code runs in its confined test runners (``_judge_runner.py``, ``_jail.py``), under
the sandbox uid ``job["uid"]`` when we are root. It is started on first use and restarted when it has
died. ``open_sample(job)`` hands it a sample (the tests, which never enter the sandbox) and returns the
two sockets that belong to this sample: the harness's end of the channel (inherited by the sandbox) and
the socket the verdicts come back on, one JSON line each: ``{"pid": n}``, then ``{"i", "ok", "why"}`` per
test, then ``{"done": 1}`` (or ``{"error"}`` when a test runner cannot be started or confined).
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading

_DIR = os.path.dirname(os.path.abspath(__file__))
CTL_TIMEOUT_S = 5.0


def _source(name: str) -> bytes:
    with open(os.path.join(_DIR, name), "rb") as f:
        return f.read()


# The candidate's and the judge's halves of the plain-data format are one source (see _plain.py).
JUDGE_SRC = b"\n".join(_source(n) for n in ("_plain.py", "_jail.py", "_judge_runner.py", "_judge.py"))
_BOOT = ("import os, sys\n"
         "def r(n):\n"
         "    b = b''\n"
         "    while len(b) < n:\n"
         "        c = os.read(0, n - len(b))\n"
         "        if not c:\n"
         "            raise SystemExit('judge: truncated input')\n"
         "        b += c\n"
         "    return b\n"
         "src = r(int(r(10)))\n"
         "os.close(0)\n"
         "exec(compile(src, '<ebpo-judge>', 'exec'), {'__name__': '__main__'})\n")


class _Server:
    """The long-lived judge process and the control socket samples are sent on."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"}  # no secrets, no PYTHON*
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOT, str(theirs.fileno())],
                                     stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), env=env, cwd="/",
                                     close_fds=True)
        theirs.close()
        self.proc.stdin.write(b"%010d" % len(JUDGE_SRC) + JUDGE_SRC)
        self.proc.stdin.close()
        ours.settimeout(CTL_TIMEOUT_S)  # a stuck judge costs one timeout, then it is replaced
        self.ctl = ours

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.ctl.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_LOCK = threading.Lock()
_SERVER: list = [None, None]  # [server, pid of the process that started it]


@atexit.register
def _close() -> None:
    """The judge leaves when its control socket closes; wait for it (briefly) so it is reaped."""
    server, owner = _SERVER
    if server is not None and owner == os.getpid():
        server.close()


def open_sample(job: dict) -> tuple[socket.socket, socket.socket]:
    """Start judging one sample: returns (the harness's end of the channel, the verdict socket)."""
    body = json.dumps(job).encode()
    with _LOCK:
        for attempt in range(2):
            server, owner = _SERVER
            if server is None or owner != os.getpid() or not server.alive():
                server = _SERVER[0] = _Server()
                _SERVER[1] = os.getpid()
            chan_judge, chan_harness = socket.socketpair()
            verdict_judge, verdict_ours = socket.socketpair()
            try:
                socket.send_fds(server.ctl, [b"%010d" % len(body)], [chan_judge.fileno(), verdict_judge.fileno()])
                server.ctl.sendall(body)
                break
            except OSError:  # the judge died (or hangs) between two samples: start another, once
                chan_harness.close()
                verdict_ours.close()
                server.proc.kill()
                _SERVER[0] = None
                if attempt:
                    raise
            finally:
                chan_judge.close()
                verdict_judge.close()
    return chan_harness, verdict_ours
