"""Trusted test harness, run INSIDE the sandbox as ``python -I -B _harness.py job.json``.

Standard library only (the sandbox interpreter may not be ours). This process never executes candidate
code: every test runs in a forked child with its own process group, a per-test deadline and a capped
output pipe. Children report *values* (the candidate's return values serialised as tagged plain data,
or its stdout); expected values never enter the sandbox, so the verdict is computed by the parent
outside it. Output on our stdout, one JSON object per line: {"ready":1}, one record per test, {"done":1}.
"""
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

_REAL_BUILTINS = dict(__builtins__.__dict__) if hasattr(__builtins__, "__dict__") else dict(__builtins__)
_MAX_DEPTH = 64


def _encode(v, depth=0):
    """Tagged plain data; only exact builtin types (a subclass with a lying __eq__ is rejected)."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None:
        return ["n"]
    if t is bool:
        return ["b", v]
    if t is int:
        return ["i", str(v)]
    if t is float:
        return ["f", repr(v)]
    if t is complex:
        return ["c", repr(v.real), repr(v.imag)]
    if t is str:
        return ["s", v]
    if t is bytes:
        return ["y", v.hex()]
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        return [tag, [_encode(x, depth + 1) for x in v]]
    if t is dict:
        return ["d", [[_encode(k, depth + 1), _encode(x, depth + 1)] for k, x in v.items()]]
    raise TypeError("unsupported result type " + t.__name__)


def _set_limits(lim):
    pairs = [(resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_bytes"]),
             (resource.RLIMIT_NPROC, lim["max_procs"]), (resource.RLIMIT_FSIZE, lim["file_size_bytes"]),
             (resource.RLIMIT_NOFILE, lim["open_files"]), (resource.RLIMIT_CORE, 0)]
    for res, val in pairs:
        try:
            resource.setrlimit(res, (val, val))
        except (ValueError, OSError):
            pass
    try:  # non-dumpable: children of the same uid cannot ptrace us or open /proc/<us>/fd/*
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass


def _child_common(keep):
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd, src in enumerate(keep[:3]):
        os.dup2(devnull if src is None else src, fd)
    extra = keep[3] if len(keep) > 3 else None
    for fd in range(3, 1024):
        if fd != extra:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def _probe_child(code, exprs, result_w):
    _child_common([None, None, None, result_w])
    try:
        ns = {"__name__": "solution", "__builtins__": __builtins__}
        exec(compile(code, "<solution>", "exec"), ns)
        vals = []
        for expr, names in exprs:
            g = dict(ns)
            g.update({n: _REAL_BUILTINS[n] for n in names if n in _REAL_BUILTINS})
            vals.append(_encode(eval(compile(expr, "<test>", "eval"), g)))
        payload = {"values": vals}
    except BaseException as e:  # SystemExit included: exiting early is a failure, not a pass
        payload = {"error": type(e).__name__}
    data = json.dumps(payload).encode()
    while data:
        data = data[os.write(result_w, data):]
    os._exit(0)


def _exec_child(code, src, result_w):
    _child_common([None, None, None, result_w])
    try:
        ns = {"__name__": "solution", "__builtins__": __builtins__}
        exec(compile(code, "<solution>", "exec"), ns)
        exec(compile(src, "<test>", "exec"), ns)
        payload = {"values": [["b", True]]}
    except BaseException as e:
        payload = {"error": type(e).__name__}
    os.write(result_w, json.dumps(payload).encode())
    os._exit(0)


def _stdio_child(code, stdin_fd, out_w):
    import io
    _child_common([stdin_fd, out_w, None])
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    status = 0
    try:
        exec(compile(code, "<solution>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = 0 if e.code in (None, 0) else 1
    except BaseException:
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:
        status = 1
    os._exit(status)


def _run(target, args, read_fd, close_fds, deadline, cap):
    """Fork ``target(*args)``, read ``read_fd`` until EOF/cap/deadline; return (status, bytes, exit)."""
    pid = os.fork()
    if pid == 0:
        try:
            target(*args)
        finally:
            os._exit(1)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    for fd in close_fds:
        os.close(fd)
    buf, status, exit_code, exited = bytearray(), "ok", None, False
    while True:
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        ready, _, _ = select.select([read_fd], [], [], min(deadline - now, 0.05))
        if ready:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > cap:
                status = "output_limit"
                break
            continue
        if not exited:
            wpid, wst = os.waitpid(pid, os.WNOHANG)
            if wpid:
                exited, exit_code = True, os.waitstatus_to_exitcode(wst)
        elif not ready:
            break  # child gone and nothing more to read: a grandchild may hold the pipe; stop here
    os.close(read_fd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if not exited:
        try:
            _, wst = os.waitpid(pid, 0)
            exit_code = os.waitstatus_to_exitcode(wst)
        except ChildProcessError:
            pass
    return status, bytes(buf), exit_code


def _sweep(kill_all):
    """Kill whatever the test left behind (daemons that left our process group), then reap."""
    if kill_all:  # only when we are pid 1 of a pid namespace or run under a dedicated uid
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def _emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    _set_limits(job["limits"])
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    kill_all = job["kill_all"] or os.getpid() == 1
    cap = job["max_output_bytes"]
    code = job["code"]
    end = time.monotonic() + job["total_timeout_s"]
    _emit({"ready": 1, "pid1": os.getpid() == 1})
    for i, test in enumerate(job["tests"]):
        deadline = min(time.monotonic() + job["test_timeout_s"], end)
        if deadline <= time.monotonic():
            _emit({"i": i, "status": "timeout", "budget": 1})
            continue
        r, w = os.pipe()
        if test["kind"] == "stdio":
            path = "_stdin_%d" % i
            with open(path, "w") as f:
                f.write(test["stdin"])
            in_fd = os.open(path, os.O_RDONLY)
            status, out, exit_code = _run(_stdio_child, (code, in_fd, w), r, [w, in_fd], deadline, cap)
            rec = {"i": i, "status": status, "exit": exit_code, "stdout": out.decode("utf-8", "replace")}
        else:
            target, arg = (_probe_child, test["exprs"]) if test["kind"] == "probe" else (_exec_child, test["src"])
            status, out, exit_code = _run(target, (code, arg, w), r, [w], deadline, cap)
            rec = {"i": i, "status": status, "exit": exit_code}
            if status == "ok":
                try:
                    rec.update(json.loads(out.decode()))
                except ValueError:
                    rec["status"] = "bad_output"
        _sweep(kill_all)
        _emit(rec)
    _emit({"done": 1})


if __name__ == "__main__":
    main()
