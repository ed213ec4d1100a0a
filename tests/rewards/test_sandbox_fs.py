"""What the sandbox's interpreter sees (rewards/sandbox_fs.py): an old or missing sandbox Python is a start-up
error; under bubblewrap the candidate sees the interpreter and its work directory, not the host's files; the
site-packages the caller allows are importable, others are not."""
import json
import os
import shutil
import tempfile
import textwrap

import pytest

import rewards.sandbox as sandbox
from rewards import RewardWorker
from rewards.code_reward import code_reward
from tests.rewards.hostile import BOUND, FAST, MODES, new_sample, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_python(version: list, d: str) -> str:
    """A world-executable script in ``d`` that answers the interpreter probe like a Python of ``version``."""
    os.chmod(d, 0o755)
    path = os.path.join(d, "python3")
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho '{\"version\": %s, \"implementation\": \"cpython\", \"executable\": \"%s\", "
                "\"stdlib\": \"/nonexistent\", \"platstdlib\": \"/nonexistent\", \"site\": [], \"sys_path\": [], "
                "\"maps\": []}'\n" % (version, path))
    os.chmod(path, 0o755)
    return path


def test_an_old_or_missing_sandbox_python_is_a_startup_error(monkeypatch, fresh_probes):
    d = tempfile.TemporaryDirectory(prefix="ebpo-fake-python-", dir="/tmp")  # reachable by the sandbox uid
    old = _fake_python([3, 6, 9], d.name)
    monkeypatch.setattr(sandbox, "sandbox_python", lambda: old)
    with pytest.raises(sandbox.SandboxError, match=r"is cpython 3\.6\.9; .* needs CPython >= 3\.9"):
        sandbox.resolve_mode("auto")
    with pytest.raises(sandbox.SandboxError, match="3.6.9"):
        RewardWorker([("code", 1.0, {})], num_workers=0)  # at construction, not as a 0 per sample
    monkeypatch.setattr(sandbox, "sandbox_python", lambda: "/nonexistent/python3")
    sandbox._interpreter.cache_clear()
    with pytest.raises(sandbox.SandboxError, match="does not run here"):
        sandbox.resolve_mode("rlimits")
    d.cleanup()


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
