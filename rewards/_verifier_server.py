"""The verifier server: third-party verifiers (reasoning-gym's ``score_answer``, a verifiers rubric) scored in
a jail, one forked child per answer. Started by ``rewards.verifier_sandbox`` as its own process.

Start: the first line on stdin is the configuration (JSON: ``sys_path``, ``uid``, ``mode``, ``memory_bytes``,
``timeout_s``, ``reasoning_gym``, ``vf_envs``, ``empty_root``). As the reward process's user (trusted code
only), the server imports reasoning-gym and loads the verifiers environments it is told to (a new user
namespace first when not root, since that needs a single thread), then sets the jail up (``_jail.setup``:
its own mount, network, IPC and UTS namespaces and a read-only tree; ``chroot``: an empty root-owned
directory) and answers ``{"ready": 1, "mode"}`` on stdout.

Requests: a 10-digit length then a pickle from the parent (trusted), one JSON reply line each. For a task or
environment it has not scored yet, the server first scores the row's *gold* answer itself (trusted data,
under an alarm), so that the verifier's lazy imports and caches happen here, once. The policy's answer is
scored only in a child forked for it, which confines itself before it reads the answer (``_jail.confine``:
the tree as its root, the dedicated sandbox uid, no capabilities, no new processes, no file writes, an
address-space cap of ``memory_bytes`` above the server's size, CPU seconds) and writes one JSON object
(``{"score", "metrics"}`` or ``{"error"}``) on a pipe. The server reads at most ``RESULT_BYTES`` of it,
SIGKILLs the child at ``timeout_s``, and replies ``{"id", "status": "ok"|"timeout"|"died", "out": text}``;
the parent parses ``out``. Nothing a child does survives it: it cannot fork, write a file, reach the
network (namespaces mode) or the server (another uid, non-dumpable), and module state it changes dies with
its copy of the server's memory.
"""
import gc
import json
import math
import os
import pickle
import select
import signal
import time

import rewards._jail as jail

RESULT_BYTES = 16384
# taken now, before any answer runs: an answer the verifier evaluates may rebind the builtins of its own
# child, and its verdict must not go through them
_FLOAT, _TYPE, _STR, _DUMPS = float, type, str, json.dumps


class _Warm(Exception):
    pass


def _alarm(*_):
    raise _Warm()


class Server:
    """The preloaded verifiers and the jail; ``handle(req)`` scores one request."""

    def __init__(self, cfg):
        self.cfg, self.rg, self.score_fns, self.envs, self.env_errors = cfg, None, {}, {}, {}
        self.warmed, self._spare = set(), None
        if cfg.get("reasoning_gym"):
            import reasoning_gym
            self.rg = reasoning_gym
        for ref, env_args in cfg.get("vf_envs", []):
            from rewards._vf_scoring import load_vf_environment
            key = (ref, json.dumps(env_args or {}, sort_keys=True))
            try:
                self.envs[key] = load_vf_environment(ref, env_args)
            except Exception as e:  # noqa: BLE001 - this environment's rows score 0 with the reason
                self.env_errors[key] = "%s: %s" % (type(e).__name__, str(e)[:200])
        self.root = None
        self.mode = "none"

    def score_fn(self, task):
        if task not in self.score_fns:
            try:
                self.score_fns[task] = self.rg.get_score_answer_fn(task)
            except Exception as e:  # noqa: BLE001 - an unknown task is the row's problem
                self.score_fns[task] = "%s: %s" % (type(e).__name__, str(e)[:200])
        return self.score_fns[task]

    def _score(self, req, answer):
        """The verifier's verdict on ``answer`` (runs in the confined child, or on gold data here)."""
        if req["kind"] == "probe":
            return {"score": 1.0}
        if req["kind"] == "rg":
            return {"score": _FLOAT(self.score_fns[req["task"]](answer, req["entry"]))}
        import asyncio
        from rewards._vf_scoring import score_with_rubric
        env = self.envs[req["env_key"]]
        reward, metrics = asyncio.run(score_with_rubric(env, req["input"], answer))
        return {"score": _FLOAT(reward),
                "metrics": {_STR(k): _FLOAT(v) for k, v in metrics.items() if _TYPE(v) in (int, _FLOAT, bool)}}

    def _warm(self, req, key):
        """Score the gold answer here once per task / environment (trusted inputs), so that lazy imports
        and caches are in the memory every child starts from."""
        if key in self.warmed:
            return
        self.warmed.add(key)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(self.cfg["warm_s"]))
        try:
            self._score(req, req["gold"])
        except BaseException:  # noqa: BLE001 - a gold answer the verifier refuses warms what it can
            pass
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        gc.collect()
        gc.freeze()
        self.drop_spare()  # forked before the warm-up: it lacks what the warm-up imported

    def handle(self, req):
        """Reply to one request: a skip or an error known here, else the confined child's result."""
        if req["kind"] == "rg":
            fn = self.score_fn(req["task"])
            if isinstance(fn, str):
                return {"status": "skip", "out": "reasoning-gym has no task %r: %s" % (req["task"], fn)}
            self._warm(req, ("rg", req["task"]))
        else:
            if req["env_key"] in self.env_errors:
                return {"status": "ok", "out": json.dumps({"error": self.env_errors[req["env_key"]]})}
            if req["env_key"] not in self.envs:
                return {"status": "skip", "out": "environment not loaded"}
            self._warm(req, ("vf",) + tuple(req["env_key"]))
        return self.run_child(req)

    def spare(self):
        """A child forked ahead and confined, waiting for its one request (the fork, the largest cost of
        an answer, then overlaps with the parent's own work). Forked again after every answer, and after a
        warm-up (it must start from the warmed memory)."""
        if self._spare is None:
            req_r, req_w = os.pipe()
            res_r, res_w = os.pipe()
            memory = jail.address_space_bytes() + self.cfg["memory_bytes"]
            cpu = int(math.ceil(float(self.cfg["timeout_s"]))) + 1
            pid = os.fork()
            if pid == 0:
                self._child(req_r, res_w, memory, cpu)
            os.close(req_r)
            os.close(res_w)
            self._spare = (pid, req_w, res_r)
        return self._spare

    def _child(self, req_r, res_w, memory, cpu):
        """The confined child: confine, read the request, score it, write the result, exit."""
        code = 0
        try:
            jail.confine(self.root, self.cfg["uid"], {req_r, res_w}, memory, cpu)
        except BaseException:  # not confined: the request is never read
            os._exit(3)
        try:
            req = pickle.loads(_read_exact(int(_read_exact(10, req_r)), req_r))
            text = _DUMPS(self._score(req, req.get("answer")))
        except BaseException as e:  # noqa: BLE001 - the verifier's failure on this answer
            try:
                text = json.dumps({"error": "%s: %s" % (type(e).__name__, str(e)[:200])})
            except BaseException:
                text = '{"error": "unprintable exception"}'
        try:
            data = text.encode()[:RESULT_BYTES]
            while data:
                data = data[os.write(res_w, data):]
        except BaseException:
            code = 1
        os._exit(code)

    def drop_spare(self):
        if self._spare is not None:
            pid, req_w, res_r = self._spare
            self._spare = None
            os.close(req_w)
            self._reap(pid, res_r)

    def run_child(self, req):
        """Hand ``req`` to the spare child; its confined result, or why there is none."""
        pid, req_w, res_r = self.spare()
        self._spare = None
        deadline = time.monotonic() + float(self.cfg["timeout_s"])
        body = pickle.dumps(req)
        try:
            data = b"%010d" % len(body) + body
            while data:
                data = data[os.write(req_w, data):]
        except OSError:  # it died before its request (it could not be confined, or was killed)
            pass
        os.close(req_w)
        return self._collect(pid, res_r, deadline)

    def _collect(self, pid, r, deadline):
        buf, status = b"", "ok"
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                status = "timeout"
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf = (buf + chunk)[:RESULT_BYTES]
        st = self._reap(pid, r)
        if status == "ok" and not (os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0):
            status = "not_confined" if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 3 else "died"
        return {"status": status, "out": buf.decode("utf-8", "replace")}

    def _reap(self, pid, r):
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        return os.waitpid(pid, 0)[1]


def _read_exact(n, fd=0):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf
def _reply(obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _probe(server):
    """A child confined as the real ones are must start and answer: otherwise no answer is ever scored."""
    out = server.run_child({"kind": "probe"})
    return out["status"] == "ok" and json.loads(out["out"] or "{}").get("score") == 1.0, out["status"]


def main(cfg):
    """Set up, say ready, serve requests until stdin closes (the parent is gone)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    mode = cfg["mode"]
    userns = False
    if mode in ("auto", "namespaces") and os.geteuid() != 0:
        try:
            jail.enter_user_namespace()  # before any import can start a thread
            userns = True
        except OSError:
            pass
    server = Server(cfg)
    gc.collect()
    gc.freeze()
    if mode == "none":
        server.mode, server.root = "none", None
    elif mode == "chroot" or (mode == "auto" and os.geteuid() != 0 and not userns):
        server.mode, server.root = ("chroot", cfg["empty_root"]) if os.geteuid() == 0 else ("none", None)
    else:
        server.mode, server.root = jail.setup(empty_root=cfg["empty_root"])
    if mode not in ("auto", server.mode):
        _reply({"ready": 0, "error": "verifier sandbox mode %r does not work here (got %r)" % (mode, server.mode)})
        return
    jail.non_dumpable()
    ok, why = _probe(server)
    if not ok:
        _reply({"ready": 0, "error": "a confined child does not start in mode %s: %s" % (server.mode, why)})
        return
    _reply({"ready": 1, "mode": server.mode, "pid": os.getpid()})
    while True:
        server.spare()  # while the parent is busy elsewhere
        try:
            req = pickle.loads(_read_exact(int(_read_exact(10))))  # from the parent: trusted
        except EOFError:
            server.drop_spare()
            return
        out = server.handle(req)
        _reply(dict(out, id=req.get("id")))
