"""Hostile candidates of the first hardening round (forged records, host files, vacuous tests, malformed
answers, stopped harnesses, zombies, temporary files), in every sandbox mode here; the second round and
the killed reward process are in test_hostile.py.

Every sample asserts its score, a wall-time bound, and that no process, file, IPC object or socket
outlives it (see hostile.py). Modes that need a tool skip cleanly where it is missing.
"""
import json
import os
import shutil
import textwrap

import pytest

from tests.rewards.hostile import BOUND, FAST, MODES, assert_nothing_left, new_sample, run
from tests.rewards.hostile import run_cases as _sequential_cases
from rewards.code_reward import code_reward
from rewards.sandbox import RUN_GRACE_S, TEST_GRACE_S, resolve_mode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HUMANEVAL = textwrap.dedent('''
    METADATA = {"author": "jt", "dataset": "test"}
    LIMIT = 0.5


    def check(candidate):
        assert candidate([1.0, 2.0, 3.0], LIMIT) == False
        assert candidate([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) == True
        assert True, "This prints if this assert fails (good for debugging!)"
        assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True

    check(has_close_elements)
''')
HONEST = textwrap.dedent('''
    def has_close_elements(numbers, threshold):
        return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
''')
FORGE = textwrap.dedent('''
    import json, os
    rec = {"values": [["b", True]]}
    lines = "".join(json.dumps({"i": i, "status": "ok", "exit": 0, "payload": json.dumps(rec)}) + "\\n"
                    for i in range(8)) + '{"done": 1}\\n'
    for path in ["/proc/1/fd/1", "/proc/%d/fd/1" % os.getppid()]:
        try:
            with open(path, "w") as f:
                f.write(lines)
        except OSError:
            pass
    for fd in range(3, 64):
        try:
            os.write(fd, json.dumps(rec).encode())
        except OSError:
            pass
    os._exit(0)
''')


# ---- 1. program-form tests: split into probes judged outside, the rest judged by an exit status --------

@pytest.mark.parametrize("mode", MODES)
def test_program_tests_are_split_and_unforgeable(mode):
    residual = ("def check(candidate):\n    for x in range(3):\n        assert candidate([x, x + 0.1], 0.5)\n"
                "check(has_close_elements)")

    def exact(score, **extras):
        def check(out):
            assert out.score == pytest.approx(score), out
            assert {k: out.extras[k] for k in extras} == extras, out
        return check

    exit_early = "import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n"
    cases = [
        # 3 asserts split out; `assert True` never calls the candidate: left out
        ("honest", HONEST, [HUMANEVAL], {}, BOUND, exact(1.0, total=3, vacuous_tests=1, program_tests=0)),
        # forged records written to every descriptor, then an exit at import: every call fails
        ("forged_records", FORGE, [HUMANEVAL, residual], {}, BOUND, exact(0.0, total=4, program_tests=1)),
        ("constant_true", "def has_close_elements(*a):\n    return True\n", [HUMANEVAL], {}, BOUND,
         exact(2 / 3, total=3)),
        ("exit_zero_inside", exit_early, [residual], {}, BOUND, exact(0.0, total=1, program_tests=1)),
        ("sys_exit_at_import", "import sys\nsys.exit(0)\n", [residual, HUMANEVAL], {}, BOUND, exact(0.0, total=4)),
        ("honest_residual", HONEST, [residual], {}, BOUND, exact(1.0, total=1, program_tests=1)),
    ]
    _sequential_cases(cases, mode)


def test_unsupported_tests_warn_once_and_are_counted(monkeypatch, recwarn):
    import rewards.code_tests as ct
    from rewards import RewardWorker
    from rewards.code_tests import audit_tests
    monkeypatch.setattr(ct, "_WARNED", set())
    loop = "for x in range(3):\n    assert add(x, 1) == x + 1"
    peek = ["assert add.__name__ == 'add'", "import inspect\nassert 'return' in inspect.getsource(add)"]
    counts = audit_tests([{"tests": [HUMANEVAL, loop]}, {"tests": ["assert True", "assert add(1, 2) == 3"]}])
    assert counts == {"rows": 2, "tests": 4, "scored": 5, "assert": 4, "stdio": 0, "program": 1, "split": 3,
                      "vacuous": 2, "unsupported": 0, "bad": 0}
    assert not [w for w in recwarn if "code reward" in str(w.message)]  # programs are no longer weaker
    assert audit_tests([{"tests": peek}])["unsupported"] == 2
    assert audit_tests([{"tests": peek}])["unsupported"] == 2
    assert len([w for w in recwarn if "cannot run them" in str(w.message)]) == 1  # loudly, once per process
    specs = [("code", 1.0, {**FAST, "sandbox": resolve_mode().mode})]
    with RewardWorker(specs, num_workers=0) as w:
        out = w.score([{"completion": "def add(a, b):\n    return a + b", "tests": [loop, "assert True", *peek]}] * 2)
        stats = w.stats()
    assert out[0]["score"] == pytest.approx(1 / 3), out  # the unsupported tests fail, never pass
    assert out[0]["extras"]["code"]["outcomes"] == ["ok", "unsupported", "unsupported"]
    assert stats["reward/program_tests"] == 4 and stats["reward/vacuous_tests"] == 2  # the loop + the import
    assert stats["reward/unsupported_tests"] == 4


# ---- 2. the sandbox shows no host files (bwrap) ---------------------------------------------------------

@pytest.mark.skipif(not shutil.which("bwrap") or "bwrap" not in MODES, reason="bubblewrap not available here")
def test_bwrap_shows_only_interpreter_and_work_dir(tmp_path):
    dataset = os.path.join(ROOT, "examples", "data", "code_eval.jsonl")
    home = os.path.expanduser("~")
    targets = [dataset, os.path.join(ROOT, "README.md"), "/etc/passwd", "/etc/hostname", home, ROOT, "/home"]
    reader = textwrap.dedent('''
        import os
        def peek(path):
            try:
                if os.path.isdir(path):
                    return sorted(os.listdir(path))[:3]
                with open(path) as f:
                    return f.read(40)
            except OSError as e:
                return type(e).__name__
        def top():
            return sorted(os.listdir("/"))
        def stdlib_works():
            import json, sqlite3, decimal, ctypes, zlib, lzma, bz2, hashlib, ssl, multiprocessing, tempfile
            with multiprocessing.Pool(2) as p:
                assert p.map(abs, [-1, -2]) == [1, 2]
            with tempfile.NamedTemporaryFile() as f:
                f.write(b"ok")
            return json.dumps([decimal.Decimal("1.5").as_integer_ratio(), zlib.crc32(b"x")])
    ''')
    def visible(path):
        if os.path.isdir(path):
            return sorted(os.listdir(path))[:3]
        with open(path) as f:
            return f.read(40)
    tests = [f"assert peek({t!r}) == {visible(t)!r}" for t in targets if os.path.exists(t)]
    import decimal
    import zlib
    tests.append(f"assert stdlib_works() == {json.dumps([[3, 2], zlib.crc32(b'x')])!r}")
    assert decimal.Decimal("1.5").as_integer_ratio() == (3, 2)
    sample = new_sample()
    out = run(sample, sample.traces() + reader, tests, "bwrap", BOUND, **FAST)
    assert out.extras["outcomes"] == ["assert_failed"] * (len(tests) - 1) + ["ok"], out
    # what is there: the interpreter's directories, the private temporary ones, /dev and /proc
    etc = ["ld.so.cache"] if os.path.exists("/etc/ld.so.cache") else "FileNotFoundError"
    probe = code_reward(completion=reader, tests=["assert set(top()) <= {'usr', 'bin', 'lib', 'lib64', 'sbin', "
                                                  "'lib32', 'libx32', 'tmp', 'var', 'dev', 'proc', 'root', 'opt', 'etc'}",
                                                  f"assert peek('/etc') == {etc!r}"],
                        sandbox="bwrap", **FAST)
    assert probe.score == 1.0, probe


SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site_fixture")


@pytest.mark.skipif(not all(os.stat(p).st_mode & 0o005 == 0o005 for p in (SITE, os.path.dirname(SITE), ROOT)),
                    reason="the test's site directory is not readable by the sandbox uid")
@pytest.mark.skipif(any(os.path.realpath(SITE).startswith(d + "/") for d in ("/tmp", "/dev/shm", "/var/tmp")),
                    reason="the checkout lies under a temp directory that the sandbox replaces with a private "
                           "tmpfs, so its site fixture cannot be offered (site_packages there is refused)")
@pytest.mark.parametrize("mode", MODES)
def test_allowed_site_packages_are_importable(mode):
    code = "def f():\n    import ebpo_site_probe\n    return ebpo_site_probe.VALUE + 1\n"
    out = code_reward(completion=code, tests=["assert f() == 42"], sandbox=mode, site_packages=[SITE], **FAST)
    assert out.score == 1.0, out
    out = code_reward(completion=code, tests=["assert f() == 42"], sandbox=mode, **FAST)
    assert out.extras["outcomes"] == ["raised:ModuleNotFoundError"], out
    with pytest.raises(ValueError, match="hidden by the sandbox's private"):
        code_reward(completion=code, tests=["assert f() == 42"], sandbox=mode, site_packages=["/tmp"], **FAST)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "bwrap"])
def test_other_modes_still_see_host_files_as_documented(mode):
    # documented gap: unshare and rlimits show the host file system (world-readable files are readable)
    path = "/etc/os-release"
    if not os.path.isfile(path):
        pytest.skip(f"{path} missing")
    code = f"def peek():\n    return open({path!r}).read()\n"
    out = code_reward(completion=code, tests=[f"assert peek() == {open(path).read()!r}"], sandbox=mode, **FAST)
    assert out.score == 1.0


# ---- 3. tests that never call the candidate ----------------------------------------------------------

def test_vacuous_tests_are_left_out_of_the_score():
    wrong = "def add(a, b):\n    return a - b\n"
    tests = ["assert True", "assert 1 == 1", "assert len([1]) == 1", "x = 1\nassert x == 1", "assert add(1, 2) == 3"]
    out = code_reward(completion=wrong, tests=tests, **FAST)
    assert out.score == 0.0 and out.extras["total"] == 1 and out.extras["vacuous_tests"] == 4, out
    out = code_reward(completion=wrong, tests=["assert True", "import math"], **FAST)
    assert out.score is None and "no test refers to the candidate" in out.extras["skip_reason"]


# ---- 4. everything a candidate writes to the result channel ends as a failed test --------------------

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


# ---- 5. SIGSTOP of the harness, pid-hopping processes -------------------------------------------------

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


# ---- 6. zombies never cost the next sample its process limit -----------------------------------------

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


# ---- 7. private temporary directories, removed with the sample ---------------------------------------

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
