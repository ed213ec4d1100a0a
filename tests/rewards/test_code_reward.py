"""Code reward (rewards/code_reward.py): verdicts, both test styles, adversarial completions in every sandbox mode
here, and the timeout budget check that names both keys."""
import concurrent.futures as cf
import dataclasses
import os
import socket
import time
import uuid

import pytest

import rewards.sandbox as sandbox
from rewards import RewardWorker, check_timeout_budget
from rewards.code_reward import code_reward, extract_code, total_budget_s
from rewards.sandbox import mode_works, resolve_mode
from tests.rewards.hostile import marked_processes

MODES = [m for m in ("bwrap", "unshare", "rlimits") if m == "rlimits" or mode_works(m)]
FAST = dict(test_timeout_s=1.0, total_timeout_s=4.0)

ADD = "def add(a, b):\n    return a + b\n"


def _run(code, tests, mode, **kw):
    return code_reward(completion=code, tests=tests, sandbox=mode, **{**FAST, **kw})


@pytest.mark.parametrize("mode", MODES)
def test_pass_rate_matches_hand_count(mode):
    tests = ["assert add(2, 3) == 5", "assert add(1, 1) == 3", "assert abs(add(0.1, 0.2) - 0.3) < 1e-9",
             "assert add('a', 'b') == 'ab'", "x = add(1, 2)\nassert x == 3", "assert add(1, [])"]
    out = _run(f"```python\n{ADD}```", tests, mode)
    # by hand: pass, fail, pass, pass, pass, raises TypeError -> 4/6
    assert out.score == pytest.approx(4 / 6)
    assert out.extras["sandbox"] == mode and out.extras["passed"] == 4 and out.extras["program_tests"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_stdin_stdout_tests(mode):
    prog = "import sys\nnums = [int(t) for t in sys.stdin.read().split()]\nprint(sum(nums))\n"
    tests = [{"input": "1 2 3\n", "output": "6\n"}, {"input": "10 -4", "output": "6"},
             {"input": "5", "output": "6"}]
    assert _run(prog, tests, mode).score == pytest.approx(2 / 3)
    crash = "raise SystemExit(2)"
    assert _run(crash, [{"input": "", "output": ""}], mode).score == 0.0


def test_code_extraction():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_bad_tests_and_infrastructure_failures_skip(monkeypatch):
    assert code_reward(completion=ADD, tests=None).score is None
    assert code_reward(completion=ADD, tests=[42]).score is None
    import rewards.code_reward as cr
    broken = dataclasses.replace(resolve_mode("rlimits"), python="/nonexistent/python3")
    monkeypatch.setattr(cr, "resolve_mode", lambda mode: broken)
    out = code_reward(completion=ADD, tests=["assert add(1, 2) == 3"])
    assert out.score is None and "sandbox failure" in out.extras["skip_reason"]


# ---- adversarial completions ---------------------------------------------------------------------

def _adversaries(tmp_path, secret_name, secret, port, marker):
    outside = tmp_path / "outside.txt"
    return {
        "infinite_loop": ("def f():\n    while True:\n        pass\n", ["assert f() == 1"] * 3),
        "fork_bomb": ("import os\ndef f():\n    while True:\n        try:\n            os.fork()\n"
                      "        except OSError:\n            pass\n", ["assert f() == 1"]),
        "memory_bomb": ("def f():\n    xs = []\n    while True:\n        xs.append(bytearray(50 * 2**20))\n",
                        ["assert f() == 1"]),
        "huge_print_stdio": ("while True:\n    print('x' * 10000)\n", [{"input": "", "output": "x"}]),
        "huge_print_probe": ("def f():\n    while True:\n        print('y' * 10000)\n", ["assert f() == 1"]),
        "write_outside": (f"def f():\n    try:\n        open({str(outside)!r}, 'w').write('pwned')\n"
                          f"    except OSError:\n        return 0\n    return 1\n", ["assert f() == 1"]),
        "read_secret": ("import os\ndef leak():\n"
                        f"    v = os.environ.get({secret_name!r})\n    if v:\n        return v\n"
                        "    for p in os.listdir('/proc'):\n        try:\n"
                        "            data = open('/proc/%s/environ' % p, 'rb').read().decode()\n"
                        "        except Exception:\n            continue\n"
                        f"        for kv in data.split('\\0'):\n            if kv.startswith({secret_name!r} + '='):\n"
                        "                return kv.split('=', 1)[1]\n    return None\n",
                        [f"assert leak() == {secret!r}"]),
        "kill_parent": ("import os, signal\ndef f():\n    for p in os.listdir('/proc'):\n"
                        "        if p.isdigit() and int(p) != os.getpid():\n            try:\n"
                        "                os.kill(int(p), signal.SIGKILL)\n            except OSError:\n"
                        "                pass\n    return 1\n", ["assert f() == 2"]),
        "network": ("import socket\ndef f():\n    try:\n"
                    f"        socket.create_connection(('127.0.0.1', {port}), timeout=0.5).sendall(b'hi')\n"
                    "        return 1\n    except OSError:\n        return 0\n", ["assert f() == 1"]),
        "daemon": ("import os, sys\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n"
                   "        if os.fork() == 0:\n"
                   "            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
                   f"{marker!r}])\n"
                   "        os._exit(0)\n    return 1\n", ["assert f() == 2"]),
        # reward hacks: each must score 0
        "eq_always_true": ("class A:\n    def __eq__(self, other):\n        return True\n"
                           "    __hash__ = object.__hash__\n"
                           "class I(int):\n    def __eq__(self, other):\n        return True\n"
                           "def f(x):\n    return A()\ndef g(x):\n    return I(0)\n",
                           ["assert f(2) == 4", "assert g(3) == 9", "assert 9 == f(3)"]),
        "forge_harness": (
            "import sys, os, json, gc\n"
            "main = sys.modules.get('__main__')\n"
            "if main is not None and hasattr(main, '_encode'):\n"
            "    main._encode = lambda v, depth=0: ['b', True]\n"
            "f = sys._getframe()\n"
            "while f is not None:\n"
            "    for k in ('status', 'passed', 'result', 'ok'):\n"
            "        if k in f.f_locals:\n"
            "            f.f_locals[k] = True\n"
            "    f = f.f_back\n"
            "for fd in range(3, 64):\n"
            "    try:\n"
            "        os.write(fd, json.dumps({'values': [['b', True]]}).encode())\n"
            "    except OSError:\n"
            "        pass\n"
            "os._exit(0)\n", ["assert sq(2) == 4", "assert sq(3) == 9"]),
        "exit_zero_early": ("import sys\nsys.exit(0)\n", ["assert sq(2) == 4"]),
        "os_exit_zero_early": ("import os\nos._exit(0)\n", ["assert sq(2) == 4"]),
    }


@pytest.mark.parametrize("mode", MODES)
def test_adversarial_completions(mode, tmp_path, monkeypatch):
    info = resolve_mode(mode)
    secret_name, secret = "EBPO_TEST_SECRET", "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv(secret_name, secret)
    os.chmod(tmp_path, 0o755)  # not world-writable: the sandbox must not write here
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    marker = "ebpo-daemon-" + uuid.uuid4().hex
    cases = _adversaries(tmp_path, secret_name, secret, server.getsockname()[1], marker)
    if not (info.dedicated_uid or info.pid_namespace):
        # Without a separate uid or pid namespace nothing stops a same-uid kill: documented, not tested.
        cases.pop("kill_parent")
        cases.pop("write_outside")

    def one(item):
        name, (code, tests) = item
        t0 = time.monotonic()
        out = code_reward(completion=code, tests=tests, sandbox=mode, **FAST)
        return name, out, time.monotonic() - t0

    with cf.ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(one, cases.items()))
    try:
        accepted = server.accept()[0]
        accepted.close()
        connected = True
    except BlockingIOError:
        connected = False
    finally:
        server.close()
    time.sleep(0.2)
    for name, out, seconds in results:
        if name == "network" and not info.network_isolated:
            assert out.score == 1.0  # documented gap: rlimits mode leaves the network open
            continue
        assert out.score == 0.0, (name, out)
        assert out.extras["sandbox"] == mode
        assert seconds < FAST["total_timeout_s"] + 6, (name, seconds)
    assert not (tmp_path / "outside.txt").exists()
    assert marked_processes(marker) == [], "a daemonized child outlived the sandbox"
    if info.network_isolated:
        assert not connected, "the sandbox reached a host socket"
    else:
        assert mode == "rlimits" and connected  # documented: no network isolation in this mode
    if info.dedicated_uid:
        # only what this process started (its descendants; the machine is shared with other jobs' sandboxes)
        from tests.rewards.hostile import leftover_processes
        leftovers = [p for p in leftover_processes(set()) if p[2] not in "ZX"]
        assert leftovers == [], "sandbox processes survived"


def test_timeout_budget_check_names_both_keys():
    assert total_budget_s({}) == 20 + sandbox.RUN_GRACE_S + sandbox.CLEANUP_S
    assert total_budget_s({"total_timeout_s": 5, "sandbox": "bwrap"}) == 5 + sandbox.RUN_GRACE_S + sandbox.CLEANUP_S
    with pytest.raises(ValueError, match=r"reward\.timeout_s \(10 s\).*reward\.fns\[0\]\.kwargs\.total_timeout_s \(20 s\)"):
        check_timeout_budget([("code", 1.0, {})], 10)
    specs = [("math", 1.0, {}), {"ref": "code", "kwargs": {"total_timeout_s": 30}}]
    with pytest.raises(ValueError, match=r"reward\.fns\[1\]\.kwargs\.total_timeout_s \(30 s\)"):
        check_timeout_budget(specs, 30)
    check_timeout_budget(specs, 40)  # long enough
    check_timeout_budget([("math", 1.0, {})], 1)  # no code reward: nothing to check
    with pytest.warns(UserWarning, match="RewardWorker timeout_s"):
        RewardWorker([("code", 1.0, {"total_timeout_s": 4})], num_workers=1, timeout_s=5).close()
