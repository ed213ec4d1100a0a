"""The verifier sandbox, parent side: third-party verifiers never run in the reward process.

``score(kind, request, ...)`` sends one answer to this process's verifier server (``_verifier_server.py``,
started on first use, restarted when it died, hung, or lacks a verifiers environment a row needs) and
returns the child's result as plain data: a float score (and numeric metrics), an error text, or a
timeout. The server preloads the libraries as this process's user (trusted code) and scores each policy
answer in a forked child that confines itself first (``_jail.confine``). Modes (``mode="auto"`` takes the
first that works; ``docs/rewards.md`` says what each does not protect):

- ``namespaces``: own mount, network, IPC and UTS namespaces, a read-only tree with only the interpreter,
  its libraries and shared objects as the root; as root, a dedicated sandbox uid per server (the code
  sandbox's range, ``sandbox_uids.Slot``); otherwise a user namespace, the caller's uid on the host.
- ``chroot``: root where namespaces are refused (a container): the sandbox uid and an empty root-owned
  directory as the root; the network stays open.
- ``none``: non-root without user namespaces: a separate process with the rlimits and the deadline only,
  as the caller's uid (warned once).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from rewards import sandbox_uids

_LOG = logging.getLogger("rewards.verifier_sandbox")
MODES = ("auto", "namespaces", "chroot", "none")
WARM_S = 10  # the longest the server's warm-up on a gold answer may take (trusted; this only bounds a bug)
START_TIMEOUT_S = 300.0  # importing reasoning-gym and loading environments, on a loaded machine
GRACE_S = 3.0            # the server kills a child at its deadline; we kill the server this long after
RETRY_S = 60.0           # a server that failed to start is not tried again for this long (same settings)
_BOOT = ("import json, os, sys\n"
         "b = b''\n"
         "while not b.endswith(b'\\n'):\n"
         "    c = os.read(0, 1)\n"
         "    if not c:\n"
         "        raise SystemExit('verifier server: no configuration')\n"
         "    b += c\n"
         "cfg = json.loads(b)\n"
         "sys.path[:] = cfg['sys_path']\n"
         "from rewards._verifier_server import main\n"
         "main(cfg)\n")
_THREADS_ONE = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                 "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")}
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
             "HF_DATASETS_OFFLINE", "XDG_CACHE_HOME", "TMPDIR")


class VerifierSandboxError(RuntimeError):
    """The verifier server could not start (or the requested mode does not work here)."""


class _Server:
    """One running verifier server and what it was started with."""

    def __init__(self, cfg: dict):
        self.cfg, self.slot, self.empty_root, self.proc = cfg, None, None, None
        self.warmed: set = set()
        self.gone = False  # it exited (rather than ran late) during the last request
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg = dict(self.cfg, uid=None, sys_path=[p for p in sys.path], empty_root=None)
        if os.geteuid() == 0:
            from rewards.sandbox import uid_range_checked
            uid_range_checked()
            self.slot = sandbox_uids.Slot(True)
            cfg["uid"] = self.slot.__enter__()
            self.empty_root = tempfile.mkdtemp(prefix="ebpo-vjail-")
            os.chmod(self.empty_root, 0o555)
            cfg["empty_root"] = self.empty_root
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env={**env, **_THREADS_ONE},
                                     cwd=os.getcwd(), start_new_session=True)
        os.write(self.proc.stdin.fileno(), (json.dumps(cfg) + "\n").encode())
        self.buf = b""
        ready = self._line(time.monotonic() + START_TIMEOUT_S)
        if not ready or not ready.get("ready"):
            self.stderr.seek(0)
            tail = self.stderr.read()[-1500:].decode("utf-8", "replace")
            why = (ready or {}).get("error") or "it exited or did not answer"
            raise VerifierSandboxError(f"the verifier sandbox did not start: {why}; stderr: {tail}")
        self.mode = ready["mode"]

    def _line(self, deadline: float) -> dict | None:
        """One JSON line from the server by ``deadline``, or None (it is gone or late: ``self.gone`` says)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk or len(self.buf) > 1 << 20:
                self.gone = True
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    def request(self, req: dict) -> dict | None:
        """The server's reply to ``req``, or None when it died or did not reply in time (then it is closed)."""
        body = pickle.dumps(req)
        try:
            os.write(self.proc.stdin.fileno(), b"%010d" % len(body))
            data = body
            while data:
                data = data[os.write(self.proc.stdin.fileno(), data):]
        except OSError:
            self.gone = True
            self.close()
            return None
        reply = self._line(time.monotonic() + float(self.cfg["timeout_s"]) + GRACE_S + self._warm_s(req))
        if reply is None or reply.get("id") != req["id"]:
            self.close()
            return None
        return reply

    def _warm_s(self, req: dict) -> float:
        """The server warms up on the gold answer the first time it sees a task: allow for that once."""
        key = ("rg", req.get("task")) if req["kind"] == "rg" else ("vf",) + tuple(req.get("env_key", ()))
        if key in self.warmed:
            return 0.0
        self.warmed.add(key)
        return float(WARM_S)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout, self.stderr):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None
        if self.slot is not None:  # the children are dead with the server (no-fork rlimit, parent-death signal)
            self.slot.dirty = True
            self.slot.__exit__(None, None, None)
            self.slot = None
        if self.empty_root is not None:
            shutil.rmtree(self.empty_root, ignore_errors=True)
            self.empty_root = None


_LOCK = threading.Lock()
_STATE: dict = {"server": None, "pid": None, "seq": 0, "warned": False}


def _server_for(kind: str, env_key, cfg: dict) -> _Server:
    """This process's server, started or restarted so that it has what ``kind`` / ``env_key`` needs."""
    server = _STATE["server"]
    if server is not None and (_STATE["pid"] != os.getpid() or not server.alive()):
        if _STATE["pid"] == os.getpid():
            server.close()
        server = None
    if server is not None:
        have = server.cfg
        same = all(have[k] == cfg[k] for k in ("mode", "memory_bytes", "timeout_s"))
        if same and (kind == "rg" and have["reasoning_gym"] or kind == "vf" and env_key in have["vf_keys"]):
            return server
        cfg = dict(cfg, reasoning_gym=have["reasoning_gym"] or cfg["reasoning_gym"],
                   vf_envs=have["vf_envs"] + [e for e in cfg["vf_envs"] if e not in have["vf_envs"]])
        server.close()
    cfg["vf_keys"] = [[ref, json.dumps(args or {}, sort_keys=True)] for ref, args in cfg["vf_envs"]]
    failed = _STATE.get("failed")
    if failed and failed[0] == json.dumps(cfg, sort_keys=True) and time.monotonic() < failed[2]:
        raise VerifierSandboxError(failed[1])  # not retried at every answer: each try costs a start
    try:
        server = _Server(cfg)
    except (VerifierSandboxError, RuntimeError, OSError) as e:
        _STATE["failed"] = (json.dumps(cfg, sort_keys=True), str(e), time.monotonic() + RETRY_S)
        raise VerifierSandboxError(str(e)) from None
    _STATE["server"], _STATE["pid"] = server, os.getpid()
    if server.mode == "none" and not _STATE["warned"]:
        _STATE["warned"] = True
        msg = ("verifier sandbox: mode 'none' (not root, and user namespaces are not allowed here): third-party "
               "verifiers run in a separate process with a deadline and rlimits only, as this user, with the "
               "network and the file system open to them; see docs/rewards.md")
        _LOG.warning(msg)
        warnings.warn(msg, stacklevel=3)
    return server


def score(kind: str, request: dict, *, gold, timeout_s: float = 5.0, memory_mb: int = 1024,
          mode: str = "auto", vf_env: tuple | None = None) -> dict:
    """Score one answer in the verifier sandbox. kind: ``rg`` (request: task, answer, entry) or ``vf``
    (request: input, answer; ``vf_env``: (ref, env_args)). ``gold``: the row's own answer, scored first by
    the server itself for each new task or environment (trusted data; warms lazy imports). Returns
    ``{"score": float, "metrics": {name: float}}``, ``{"error": text}`` or ``{"skip": text}``; a verifier
    past ``timeout_s`` or over ``memory_mb`` (above the server's own size) gives ``{"error": ...}``."""
    if mode not in MODES:
        raise ValueError(f"verifier sandbox mode must be one of {', '.join(MODES)}; got {mode!r}")
    env_key = None
    cfg = {"mode": mode, "memory_bytes": int(memory_mb) << 20, "timeout_s": float(timeout_s),
           "reasoning_gym": kind == "rg", "vf_envs": [], "warm_s": WARM_S}
    if kind == "vf":
        ref, env_args = vf_env
        env_key = [ref, json.dumps(env_args or {}, sort_keys=True)]
        cfg["vf_envs"] = [[ref, env_args or {}]]
    with _LOCK:
        for _ in range(2):
            before = _STATE["server"]
            server = _server_for(kind, env_key, dict(cfg))
            fresh = server is not before
            _STATE["seq"] += 1
            req = dict(request, kind=kind, id=_STATE["seq"], gold=gold)
            if env_key is not None:
                req["env_key"] = tuple(env_key)
            reply = server.request(req)
            if reply is not None or not server.gone or fresh:
                break  # once more only when a server started before this answer turned out to be gone
    if reply is None:
        return {"error": "the verifier sandbox died or hung (restarted for the next answer)"}
    return parse_reply(reply)


def parse_reply(reply: dict) -> dict:
    """The server's reply as plain data, checked here: a score is a finite float in [0, 1]; metrics keep
    their numeric values only; anything else the child wrote is an error."""
    status, out = reply.get("status"), reply.get("out")
    if status == "skip":
        return {"skip": str(out)[:300]}
    if status != "ok":
        return {"error": {"timeout": "the verifier ran past its deadline", "died": "the verifier died (memory?)",
                          "not_confined": "the verifier's child could not be confined"}.get(status, "no result")}
    try:
        obj = json.loads(out) if isinstance(out, str) else None
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        return {"error": "the verifier gave no result"}
    if "error" in obj:
        return {"error": str(obj["error"])[:300]}
    s = obj.get("score")
    if type(s) not in (int, float) or not 0.0 <= float(s) <= 1.0:  # NaN fails the comparison
        return {"error": f"the verifier returned {str(s)[:60]!r}"}
    metrics = obj.get("metrics") if isinstance(obj.get("metrics"), dict) else {}
    return {"score": float(s), "metrics": {str(k)[:60]: float(v) for k, v in list(metrics.items())[:64]
                                           if type(v) in (int, float) and v == v}}


@atexit.register
def close() -> None:
    """Stop this process's verifier server (at exit; when this process dies the server sees its stdin close)."""
    with _LOCK:
        server = _STATE["server"]
        if server is not None and _STATE["pid"] == os.getpid():
            server.close()
        _STATE["server"] = None
