"""Test code runs in a confined runner (rewards/_judge_runner.py, rewards/_jail.py), in every sandbox mode here: a
test that evaluates the candidate's output cannot forge other verdicts, test code that silences its process loses
its own verdict only, test code has no more authority than the candidate, and the zygote ends a runner past its
lifetime."""
import os
import socket as _socket

import pytest

from rewards.code_reward import code_reward
from rewards.sandbox import mode_works


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
