"""Hostile candidates in every sandbox mode here: verdicts the candidate cannot decide (the judge in its own
process, plain data across), work bounded on policy text and values, the per-test deadline within the total
budget, the judge's catch-all, host unix sockets, leftovers of the rlimits mode, host files the other modes
show, records that cannot be read, stopped harnesses, zombies, temporary files; and the reward process killed
mid-sample. Hostile program tests are in test_program_tests.py, the host files bubblewrap hides in
test_sandbox_fs.py.

Every sample asserts the score an honest judge gives, a wall-time bound, and that no process, file, SysV
IPC object or socket outlives it (see hostile.py). Modes that need a tool skip cleanly where missing.
"""
import os
import shutil
import textwrap

import pytest

from tests.rewards.hostile import BOUND, FAST, MODES, assert_nothing_left, new_sample, run
from tests.rewards.hostile import run_cases as _sequential_cases
from rewards.code_reward import code_reward
from rewards.sandbox import RUN_GRACE_S, TEST_GRACE_S, resolve_mode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- the reward worker itself killed mid-sample (the pool's hard timeout does this) --------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_killed_reward_process_leaves_no_sandbox_behind(mode):
    """Kill the reward process mid-sample: the harness sees its lifeline close and kills everything, the
    judge sees its channels close. The test holds a pidfd on every process the reward process started
    (taken while they run) and waits until each has exited, then checks: no luck in the timing."""
    import select
    import subprocess
    import sys
    import time

    from tests.rewards.hostile import descendants, marked_files, marked_processes
    sample = new_sample()
    # the marker appears reversed in the script's own command line, as itself only in the sandbox's child
    code = (f"import subprocess, sys, time\ndef f():\n    open({sample.marker[::-1]!r}[::-1], 'w').close()\n"
            f"    subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)', {sample.marker[::-1]!r}[::-1]])\n    time.sleep(60)\n")
    script = (f"from rewards.code_reward import code_reward\n"
              f"code_reward(completion={code!r}, tests=['assert f() == 1'], sandbox={mode!r}, "
              f"test_timeout_s=60, total_timeout_s=60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    pidfds = {}
    try:
        end = time.monotonic() + 30
        while not marked_processes(sample.marker):
            assert time.monotonic() < end and proc.poll() is None, "the sample never started"
            time.sleep(0.05)
        for pid in descendants(proc.pid):  # the judge, bwrap/unshare, the harness, the candidate, its child
            try:
                pidfds[pid] = os.pidfd_open(pid)
            except OSError:
                pass  # already gone
        assert set(marked_processes(sample.marker)) <= set(pidfds), "the sandbox's child is not ours?"
    finally:
        proc.kill()
        proc.wait()
    try:
        end = time.monotonic() + 20.0  # generous: the bound is on correctness, not on speed
        while pidfds and time.monotonic() < end:
            for done in select.select(list(pidfds.values()), [], [], 0.1)[0]:  # readable: exited
                os.close(done)
                pidfds = {p: fd for p, fd in pidfds.items() if fd != done}
        assert not pidfds, f"still running 20 s after the kill: {sorted(pidfds)}"
    finally:
        for fd in pidfds.values():
            os.close(fd)
    assert marked_processes(sample.marker) == []
    assert marked_files(sample.marker) == []  # the work dir (rlimits mode) went with the harness


# ==== round two: the judge in its own process, plain data across, bounded work in the parent ==========

EQ_ANY = "class _Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
LOOP = "def check(candidate):\n    for x in range(3):\n        assert candidate(x) == 2 * x\ncheck(double)"
COMPREHENSION = "assert all([double(a) == b for a, b in [(1, 2), (5, 10)]])"
ZERO = lambda out: (out.score == 0.0) or pytest.fail(str(out))  # noqa: E731
ONE = lambda out: (out.score == 1.0) or pytest.fail(str(out))  # noqa: E731


def _outcomes(score, outcomes):
    def check(out):
        assert out.score == pytest.approx(score) and out.extras["outcomes"] == outcomes, out
    return check


@pytest.mark.parametrize("mode", MODES)
def test_verdicts_the_candidate_cannot_decide(mode):
    """Objects equal to anything, shadowed builtins, and a pass status to find by frames or the gc."""
    tests = [LOOP, COMPREHENSION, "assert double(4) == 8"]
    shadow = ("range = lambda *a: []\nlen = lambda x: 0\nall = any = lambda x: True\nzip = lambda *a: []\n"
              "AssertionError = Exception\n")
    # walk every frame and everything the gc tracks for an exit status or an expected value, exit with
    # each candidate status, and write a pass into every descriptor
    seek = textwrap.dedent('''
        import gc, os, sys
        def _seek():
            found = []
            f = sys._getframe()
            while f is not None:
                found += [v for v in f.f_locals.values() if isinstance(v, (int, dict))]
                f = f.f_back
            for o in gc.get_objects():
                if isinstance(o, dict) and any(k in o for k in ("exit_code", "expected", "src", "tests")):
                    found.append(o)
            for fd in range(3, 64):
                try:
                    os.write(fd, b'{"v": ["b", true]}\\n1 {"v": ["b", true]}\\n')
                except OSError:
                    pass
            return found
        _FOUND = _seek()
        def double(x):
            _seek()
            for o in _FOUND:
                if isinstance(o, dict) and "exit_code" in o:
                    os._exit(o["exit_code"])
            return x + 1
    ''')
    honest = "def double(x):\n    return 2 * x\n"
    cases = [
        ("eq_any", EQ_ANY + "def double(x):\n    return _Any()\n", tests, {}, BOUND,
         _outcomes(0.0, ["bad_value"] * 3)),
        ("int_subclass", "class I(int):\n    __eq__ = lambda s, o: True\ndef double(x):\n    return I(0)\n", tests,
         {}, BOUND, ZERO),
        ("shadowed_builtins_wrong", shadow + "def double(x):\n    return x\n", tests, {}, BOUND, ZERO),
        ("shadowed_builtins_honest", shadow + honest, tests, {}, BOUND, ONE),  # the judge's builtins count
        ("frames_and_gc", seek, tests, {}, BOUND, ZERO),
        ("honest", honest, tests, {}, BOUND, _outcomes(1.0, ["ok"] * 3)),
    ]
    _sequential_cases(cases, mode)


@pytest.mark.parametrize("mode", MODES)
def test_megabytes_of_policy_text_and_of_values_cost_little(mode):
    """An honest answer behind a megabyte of nasty text scores 1; values built to be expensive in the
    parent (a set of ints that all hash alike, deep or long values) are failed calls, fast."""
    add = "```python\ndef add(a, b):\n    return a + b\n```\n"
    # the answer line written straight into the channel (building such a set would cost the candidate
    # the same quadratic time): ints k * (2**61 - 1), which all hash to 0, as a set and as tuple keys
    forge = textwrap.dedent('''
        import json, os
        def add(a, b):
            items = [["i", str(k * (2 ** 61 - 1))] for k in range(1, N)]
            value = ["S", items] if KIND == "set" else ["d", [[["t", [it]], ["n"]] for it in items]]
            line = json.dumps({"v": value}).encode() + b"\\n"
            for fd in range(3, 64):
                try:
                    os.write(fd, line)
                except OSError:
                    pass
            return 0
    ''')
    collide, collide_keys = "KIND, N = 'set', 30000\n" + forge, "KIND, N = 'dict', 15000\n" + forge
    distinct = "def add(a, b):\n    return set(range(35000))\n"
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    slow = {"test_timeout_s": 3.0}  # building 30,000 items takes the candidate a while on a loaded machine
    cases = [(f"text_{n}", add + tail, tests, slow, BOUND, ONE)
             for n, tail in [("fence_word", "```" + "a" * (1 << 20)), ("header", "```py" + "x" * (1 << 20) + "\n"),
                             ("ticks", "``\n" * (1 << 18))]]
    cases += [("colliding_set", collide, tests, slow, BOUND, _outcomes(0.0, ["bad_value"] * 2)),
              ("colliding_keys", collide_keys, tests, slow, BOUND, _outcomes(0.0, ["bad_value"] * 2)),
              ("too_long", "def add(a, b):\n    return 'x' * (2 << 20)\n", tests, slow, BOUND,
               _outcomes(0.0, ["output_limit"] * 2)),
              ("too_deep", "def add(a, b):\n    v = []\n    for _ in range(5000):\n        v = [v]\n    return v\n",
               tests, slow, BOUND, _outcomes(0.0, ["bad_value"] * 2)),
              ("distinct_set", distinct, ["assert len(add(1, 2)) == 35000"], slow, BOUND, ONE)]
    _sequential_cases(cases, mode)


@pytest.mark.parametrize("mode", MODES)
def test_per_test_deadlines_respect_the_total_budget(mode):
    """Five tests of a function that sleeps 0.7 s, 1 s each, 2.5 s in all: three pass (2.1 s, with room for
    the per-test overhead of a loaded machine), the fourth is cut at the total, the fifth never starts;
    the call ends within the total plus the sandbox's start-up, well before the parent's kill. A per-test
    deadline that ignored the total would let the fourth and fifth pass (0.7 s < 1 s each)."""
    import time
    code = "import time\ndef f():\n    time.sleep(0.7)\n    return 1\n"
    resolve_mode(mode)
    t0 = time.monotonic()
    out = code_reward(completion=code, tests=["assert f() == 1"] * 5, sandbox=mode, test_timeout_s=1.0,
                      total_timeout_s=2.5)
    seconds = time.monotonic() - t0
    assert out.score == pytest.approx(0.6) and out.extras["outcomes"] == ["ok"] * 3 + ["timeout"] * 2, out
    assert 2.4 < seconds < 2.5 + 1.5 < 2.5 + RUN_GRACE_S + 1.0, seconds  # the parent's kill: 2.5 + 3 s


@pytest.mark.parametrize("mode", MODES)
def test_an_unforeseen_answer_is_a_failed_call(mode):
    """The candidate answers with records the judge does not expect: each is a failed call, never a pass."""
    writes = ("import os\ndef f():\n    for fd in range(3, 64):\n        try:\n"
              "            os.write(fd, %r)\n        except OSError:\n            pass\n    return True\n")
    cases = [(name, writes % record, ["assert f() is not None"], {}, BOUND, _outcomes(0.0, [why]))
             for name, record, why in [("unknown_key", b'{"zzz": 1}\n', "bad_record"),
                                       ("resolve_answer", b'{"names": {"f": ["fn"]}}\n', "bad_record"),
                                       ("stdio_answer", b'{"stdout": "x"}\n', "bad_record"),
                                       ("not_a_dict", b'[1, 2]\n', "bad_record"),
                                       ("bad_tag", b'{"v": ["q", 1]}\n', "bad_value")]]
    _sequential_cases(cases, mode)


def test_the_judge_interprets_only_what_it_expects():
    from rewards._judge import PARENT_MODULES as JUDGE_PARENT_MODULES, CallFailed, _Test, interpret
    from rewards.code_tests import PARENT_MODULES
    assert JUDGE_PARENT_MODULES == PARENT_MODULES  # what the judge preloads is what compiling leaves out
    unforeseen = [(b'{"zzz": 1}', "call"), (b'{"names": {}}', "call"), (b'{"stdout": ""}', "call"),
                  (b'{"v": ["i", "1"]}', "resolve"), (b'{"v": ["i", "1"]}', "stdio"), (b'{"h": 5}', "call"),
                  (b'{"raised": 5}', "call"), (b'{}', "resolve"), (b'null', "call"), (b'"v"', "call")]
    for body, expect in unforeseen:
        test = _Test(None)
        with pytest.raises(CallFailed):
            interpret(body, test, expect)
        assert test.failed, (body, expect)
    assert interpret(b'{"v": ["l", [["i", "1"]]]}', _Test(None), "call") == [1]
    with pytest.raises(ValueError):
        interpret(b'{"raised": "ValueError"}', _Test(None), "call")


@pytest.mark.parametrize("mode", MODES)
def test_host_unix_sockets_and_leftovers(mode):
    """connect() to host unix sockets under /run and /tmp (hidden in bwrap and unshare; reachable in
    rlimits, as documented), and SysV IPC objects plus files in a nested world-writable directory left
    by every sample (sample.traces): none of them outlives the sample in any mode."""
    import socket
    import uuid
    tag = uuid.uuid4().hex[:10]
    dirs = [f"/run/ebpo-hostile-{tag}", f"/tmp/ebpo-hostile-{tag}"]
    servers = []
    try:
        for d in dirs:
            os.makedirs(d, mode=0o755)
            s = socket.socket(socket.AF_UNIX)
            s.bind(os.path.join(d, "sock"))
            os.chmod(os.path.join(d, "sock"), 0o777)  # connect() needs only write permission on the file
            s.listen(4)
            s.setblocking(False)
            servers.append(s)
        code = ("import socket\ndef reach(paths):\n    n = 0\n    for p in paths:\n"
                "        s = socket.socket(socket.AF_UNIX)\n        try:\n            s.connect(p)\n"
                "            n += 1\n        except OSError:\n            pass\n    return n\n")
        sample = new_sample()
        out = run(sample, sample.traces() + code, [f"assert reach({[d + '/sock' for d in dirs]!r}) == 0"], mode,
                  BOUND, **FAST)
        reached = 0
        for s in servers:
            try:
                s.accept()[0].close()
                reached += 1
            except BlockingIOError:
                pass
        if mode == "rlimits":  # documented: nothing hides them from a process of the host's namespaces
            assert out.score == 0.0 and reached == 2, (out, reached)
        else:
            assert out.score == 1.0 and reached == 0, (out, reached)
    finally:
        for s in servers:
            s.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_auto_warns_when_it_falls_back_to_rlimits(monkeypatch, caplog):
    import rewards.sandbox as sb
    sb._warn_rlimits_picked.cache_clear()
    real = sb.mode_works
    monkeypatch.setattr(sb, "mode_works", lambda m: m == "rlimits" and real(m))
    with pytest.warns(UserWarning, match="unix sockets"):
        assert sb.resolve_mode("auto").mode == "rlimits"
    sb._warn_rlimits_picked.cache_clear()


@pytest.mark.parametrize("mode", MODES)
def test_the_deadline_covers_judging_on_the_direct_path(mode):
    """Judging has the same deadline as running, through call_reward with no RewardWorker around it: test
    code that loops on the candidate's answer is cut by the judge's alarm, and test code that swallows
    the alarm is killed by the parent at the test's deadline plus its grace."""
    import time

    from rewards import call_reward
    from rewards.code_reward import code_reward as fn
    from rewards.sandbox import TEST_GRACE_S
    code = "def f():\n    return 10 ** 12\n"
    tests = ["total = 0\nfor k in range(f()):\n    total += k\nassert total >= 0",
             "import time\nwhile True:\n    try:\n        f()\n        time.sleep(1)\n    except BaseException:\n"
             "        pass",
             "assert f() == 10 ** 12"]
    sample = new_sample()
    t0 = time.monotonic()
    out = call_reward(fn, {"completion": sample.traces() + code, "tests": tests},
                      {"sandbox": mode, "test_timeout_s": 1.0, "total_timeout_s": 20.0})
    seconds = time.monotonic() - t0
    assert out.extras["outcomes"][0] == "timeout" and out.extras["outcomes"][1] == "timeout", out
    assert seconds < 2 * 1.0 + TEST_GRACE_S + RUN_GRACE_S, seconds  # far below total_timeout_s = 20 s
    from tests.rewards.hostile import assert_nothing_left
    assert_nothing_left(sample)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "bwrap"])
def test_other_modes_still_see_host_files_as_documented(mode):
    # documented gap: unshare and rlimits show the host file system (world-readable files are readable)
    path = "/etc/os-release"
    if not os.path.isfile(path):
        pytest.skip(f"{path} missing")
    code = f"def peek():\n    return open({path!r}).read()\n"
    out = code_reward(completion=code, tests=[f"assert peek() == {open(path).read()!r}"], sandbox=mode, **FAST)
    assert out.score == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_deep_and_malformed_records_are_failed_tests(mode):
    deep_record = textwrap.dedent('''
        import os
        def f():
            for fd in range(3, 64):
                try:
                    os.write(fd, b"[" * 200000 + b"]" * 200000)
                except OSError:
                    pass
            os._exit(0)
    ''')
    deep_value = "def f():\n    v = []\n    for _ in range(5000):\n        v = [v]\n    return v\n"
    huge_int = "def f():\n    return int('9' * 4000) * 10 ** 4000\n"
    # valid JSON whose value cannot be built (a list as a dict key), then bytes that are not JSON at all
    to_channel = "import os\ndef f():\n    for fd in range(3, 64):\n        try:\n            os.write(fd, %r)\n" \
                 "        except OSError:\n            pass\n    os._exit(0)\n"
    junk = to_channel % b'{"values": [["d", [[["l", []], ["n"]]]]]}'
    garbage = to_channel % (bytes(range(256)) * 10)
    zero = lambda out: (out.score == 0.0) or pytest.fail(str(out))  # noqa: E731
    cases = [(name, code, ["assert f() == 1", "assert f() == [1]"], {}, BOUND, zero)
             for name, code in [("deep_record", deep_record), ("deep_value", deep_value), ("huge_int", huge_int),
                                ("junk", junk), ("garbage", garbage)]]
    _sequential_cases(cases, mode)


def test_deep_record_through_the_worker_is_a_zero_not_an_error():
    from rewards import RewardWorker
    code = ("import os\ndef f():\n    for fd in range(3, 64):\n        try:\n            os.write(fd, b'[' * 100000)\n"
            "        except OSError:\n            pass\n    os._exit(0)\n")
    with RewardWorker([("code", 1.0, FAST)], num_workers=1, timeout_s=30) as w:
        out = w.score([{"completion": code, "tests": ["assert f() == 1"]}])[0]
    assert out["score"] == 0.0 and not out["error"] and not out["timeout"], out


@pytest.mark.parametrize("mode", MODES)
def test_stopping_the_harness_does_not_defeat_deadlines(mode):
    stop_all = textwrap.dedent('''
        import os, signal, time
        def f():
            for p in [os.getppid(), 1] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
                if p != os.getpid():
                    try:
                        os.kill(p, signal.SIGSTOP)
                    except OSError:
                        pass
            time.sleep(30)
    ''')
    hopper = textwrap.dedent('''
        import os, time
        def f():
            if os.fork() == 0:
                os.setsid()
                while True:  # a new pid every iteration
                    try:
                        if os.fork():
                            os._exit(0)
                    except OSError:
                        time.sleep(0.001)
            time.sleep(30)
    ''')
    # three tests of 1 s each: at most 3 x (1 s + the parent's grace), not the whole budget
    bound = 3 * (FAST["test_timeout_s"] + TEST_GRACE_S) + RUN_GRACE_S
    zero = lambda out: (out.score == 0.0) or pytest.fail(str(out))  # noqa: E731
    cases = [(name, code, ["assert f() == 1"] * 3, {"total_timeout_s": 20.0}, bound, zero)
             for name, code in [("sigstop", stop_all), ("pid_hopper", hopper)]]
    _sequential_cases(cases, mode)


@pytest.mark.parametrize("mode", MODES)
def test_orphan_zombies_do_not_change_the_next_score(mode):
    zombies = textwrap.dedent('''
        import os, time
        def f():
            for _ in range(40):
                try:
                    if os.fork() == 0:
                        try:
                            if os.fork() == 0:
                                os._exit(0)  # orphaned at once, then a zombie unless its new parent reaps it
                        finally:
                            os._exit(0)
                except OSError:
                    time.sleep(0.01)
            return 1
    ''')
    forks = "import os\ndef g():\n    pids = [os.fork() or os._exit(0) for _ in range(6)]\n    " \
            "return [os.waitpid(p, 0)[1] for p in pids]\n"
    for _ in range(2):  # the same process takes the same uid again
        sample = new_sample()
        assert run(sample, zombies, ["assert f() == 1"], mode, BOUND, max_procs=10, **FAST).score == 1.0
        sample = new_sample()
        assert run(sample, forks, ["assert g() == [0] * 6"], mode, BOUND, max_procs=10, **FAST).score == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_temporary_files_are_private_and_removed(mode):
    writer = textwrap.dedent('''
        import os
        def put(name):
            for d in ("/tmp", "/dev/shm", "/var/tmp"):
                with open(os.path.join(d, name), "w") as f:
                    f.write("secret")
            return 1
        def seen(name):
            return [d for d in ("/tmp", "/dev/shm", "/var/tmp") if os.path.exists(os.path.join(d, name))]
        def fill():
            total = 0
            for i in range(32):
                try:
                    with open("/dev/shm/fill%d" % i, "wb") as f:
                        for _ in range(16):
                            f.write(b"x" * 2**20)
                            total += 2**20
                except OSError:
                    break
            return total
    ''')
    first, second = new_sample(), new_sample()
    assert run(first, writer, [f"assert put({first.marker!r}) == 1"], mode, BOUND, **FAST).score == 1.0
    # the next sample (same uid) does not see the first one's files
    assert run(second, writer, [f"assert seen({first.marker!r}) == []"], mode, BOUND, **FAST).score == 1.0
    if resolve_mode(mode).private_tmp:  # tmpfs capped at tmp_mb: 32 x 16 MiB to /dev/shm cannot all land
        out = run(second, writer, ["assert fill() < 5 * 2**20"], mode, BOUND, tmp_mb=4, **FAST)
        assert out.score == 1.0, out
    assert_nothing_left(first)
