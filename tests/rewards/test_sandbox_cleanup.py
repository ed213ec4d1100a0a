"""Round three, rlimits mode: the clean-up after a sample always finishes, on time, and never poisons a uid.

- Any tree the sandbox uid can build is removed: a chain deeper than the recursion limit and than
  PATH_MAX, symbolic links (never followed), odd names, FIFOs and sockets, floods of entries.
- The removal keeps a deadline; what does not fit is finished in the background while the uid is held
  and marked busy, so the sample returns within its documented budget and no later sample draws a uid
  with something left of an earlier one.
- A failed clean-up never raises into the sample (it was a reward error on every later sample of the
  worker) and never marks the uid free.
"""
import os
import socket
import time
import uuid

import pytest

from tests.rewards.hostile import MODES
from rewards import sandbox, sandbox_cleaner
from rewards.code_reward import code_reward
from rewards.sandbox_rmtree import remove_path
from rewards.sandbox_uids import LOCK_DIR, Slot

ROOT = os.geteuid() == 0


def _chain(top: str, depth: int, extra=lambda fd: None) -> None:
    """``top``/d/d/.../d, ``depth`` levels (built relative to descriptors: deeper than PATH_MAX)."""
    os.mkdir(top)
    cur = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        extra(cur)
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)


def _files(fd: int, n: int, prefix: str = "f") -> None:
    for i in range(n):
        os.close(os.open(f"{prefix}{i}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))


def _with_links(outside: str):
    def extra(fd):
        os.symlink("/", "root", dir_fd=fd)
        os.symlink(outside, "file", dir_fd=fd)
        os.symlink(".", "loop", dir_fd=fd)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    return extra


def _odd(fd):
    os.close(os.open("new\nline", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(os.open(b"\xff\xfe".decode("utf-8", "surrogateescape"), os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.mkfifo("fifo", dir_fd=fd)
    s = socket.socket(socket.AF_UNIX)
    here = f"/proc/self/fd/{fd}/sock"
    try:
        s.bind(here)
    except OSError:
        pass
    s.close()


def _wide(top: str) -> None:
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    _files(fd, 20000)
    for i in range(300):
        os.mkdir(f"s{i}", dir_fd=fd)
        if i % 2:
            sub = os.open(f"s{i}", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            _files(sub, 3)
            os.close(sub)
    os.close(fd)


@pytest.fixture
def scratch(tmp_path):
    """A fresh directory, on tmpfs where there is one (the shapes matter here, not the disk's speed)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        import pathlib
        tmp_path = pathlib.Path("/dev/shm") / f"ebpo-cleanup-test-{uuid.uuid4().hex[:10]}"
        tmp_path.mkdir()
    outside = tmp_path / "outside"
    outside.write_text("keep me")
    yield tmp_path, str(outside)
    assert outside.read_text() == "keep me"  # no link was followed
    remove_path(str(tmp_path), time.monotonic() + 60)


@pytest.mark.parametrize("shape", ["deep", "deep_links", "deep_odd_names", "wide", "empty_dirs"])
def test_any_tree_is_removed_without_recursion_or_following_links(scratch, shape):
    tmp, outside = scratch
    top = str(tmp / "tree")
    {"deep": lambda: _chain(top, 3000),
     "deep_links": lambda: _chain(top, 1500, _with_links(outside)),
     "deep_odd_names": lambda: _chain(top, 300, _odd),
     "wide": lambda: _wide(top),
     "empty_dirs": lambda: [os.makedirs(f"{top}/{i}/a/b") for i in range(500)]}[shape]()
    assert remove_path(top, time.monotonic() + 120)
    assert not os.path.lexists(top)


def test_the_removal_keeps_its_deadline_and_goes_on_later(scratch):
    tmp, _ = scratch
    top = str(tmp / "flood")
    _wide(top)
    t0 = time.monotonic()
    assert remove_path(top, time.monotonic() + 0.01) is False
    assert time.monotonic() - t0 < 1.0  # the deadline, plus one slice of at most a few hundred entries
    calls = 1
    while not remove_path(top, time.monotonic() + 0.05):
        calls += 1
        assert calls < 10000
    assert not os.path.lexists(top)


needs_root = pytest.mark.skipif(not ROOT, reason="the dedicated sandbox uids need root")


@needs_root
def test_an_unfinished_clean_up_is_finished_in_the_background_with_the_uid_held():
    tag = uuid.uuid4().hex[:10]
    top = f"/tmp/ebpo-cleanup-{tag}"
    slot = Slot(True)
    with slot as uid:
        _wide(top)
        for dirpath, dirnames, filenames in os.walk(top):
            for n in dirnames + filenames:
                os.chown(os.path.join(dirpath, n), uid, uid, follow_symlinks=False)
        os.chown(top, uid, uid)
        assert slot.clean(time.monotonic() + 0.001) is False
    try:
        with open(os.path.join(LOCK_DIR, str(uid)), "rb") as f:
            assert f.read(8).strip() == b"busy"  # not free while something of it is left
        with Slot(True) as other:
            assert other != uid  # and nobody else draws it meanwhile
    finally:
        assert sandbox_cleaner.wait_idle(120)
    assert not os.path.lexists(top)
    with open(os.path.join(LOCK_DIR, str(uid)), "rb") as f:
        assert f.read(8).strip() == b"free"


@needs_root
def test_a_failing_clean_up_never_raises_and_never_frees_the_uid(monkeypatch):
    import rewards.sandbox_leftovers as lo

    def broken(*a, **k):
        raise RecursionError("as shutil.rmtree did on a deep chain")
    monkeypatch.setattr(lo, "remove_files", broken)
    slot = Slot(True)
    with slot as uid:
        assert slot.clean(time.monotonic() + 1) is False
    monkeypatch.undo()
    assert sandbox_cleaner.wait_idle(60)
    with open(os.path.join(LOCK_DIR, str(uid)), "rb") as f:
        assert f.read(8).strip() == b"free"  # freed by the background clean-up once it worked


# ---- end to end: hostile trees built by the candidate, rlimits mode as root ------------------------------

BUILD = '''import os
def build(where, shape):
    top = os.path.join(where, {tag!r} + "-" + shape)
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY)
    if shape == "deep":
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    elif shape == "links":
        for i in range(200):
            os.symlink("/", "r%d" % i, dir_fd=fd)
            os.mkdir("d%d" % i, dir_fd=fd)
    else:
        for i in range(100000):
            os.close(os.open("f%d" % i, os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    return 1
'''
rlimits_root = pytest.mark.skipif(not (ROOT and "rlimits" in MODES), reason="rlimits mode with dedicated uids")


def _hostile_trees(monkeypatch, wheres, shapes, short_budget):
    """Build each shape in each place, then an honest sample on the same worker (the same uid first) must
    score 1; every sample ends within its budget. With short_budget the removal gets almost no time: it
    is then finished in the background."""
    kw = dict(test_timeout_s=3.0, total_timeout_s=6.0, sandbox="rlimits")
    limits = sandbox.Limits(test_timeout_s=3.0, total_timeout_s=6.0)
    if short_budget:
        monkeypatch.setattr(sandbox, "CLEANUP_MARGIN_S", sandbox.wall_bound_s(limits))
    bound = sandbox.wall_bound_s(limits) + 1.0  # + the start of the call (compiling the tests, the judge)
    tag = "ebpo-cleanup-" + uuid.uuid4().hex[:10]
    for where in wheres:
        for shape in shapes:
            t0 = time.monotonic()
            # the build may time out on a slow disk: what it made by then is what must go
            out = code_reward(completion=BUILD.format(tag=tag), tests=[f"assert build({where!r}, {shape!r}) == 1"],
                              **kw)
            assert time.monotonic() - t0 < bound, (where, shape, time.monotonic() - t0, out)
            honest = code_reward(completion="def f(x):\n    return x + 1\n", tests=["assert f(1) == 2"], **kw)
            assert honest.score == 1.0, (where, shape, honest)
    assert sandbox_cleaner.wait_idle(180)
    left = [p for d in ("/tmp", "/dev/shm") for p in os.listdir(d) if p.startswith(tag)]
    assert left == []


@rlimits_root
def test_a_deep_chain_left_by_the_candidate_is_gone_and_the_worker_goes_on(monkeypatch):
    _hostile_trees(monkeypatch, ["/dev/shm"], ["deep"], short_budget=False)
    _hostile_trees(monkeypatch, ["/dev/shm"], ["deep"], short_budget=True)


@pytest.mark.slow
@rlimits_root
@pytest.mark.parametrize("short_budget", [False, True])
def test_hostile_trees_everywhere_are_gone_and_the_worker_goes_on(monkeypatch, short_budget):
    _hostile_trees(monkeypatch, ["/tmp", "/dev/shm", "."], ["deep", "links", "flood"], short_budget)


# ---- what rlimits mode cannot stop: named at start-up, and auto prefers a mode that can ------------------

def test_auto_prefers_a_mode_that_hides_unsticky_directories_and_rlimits_names_them(monkeypatch):
    import rewards.sandbox as sb
    from rewards.sandbox_leftovers import unsticky_dirs
    tag = uuid.uuid4().hex[:10]
    session = f"/tmp/ebpo-ray-like-{tag}/session_1"  # like /tmp/ray/session_*: world-writable, no sticky bit
    os.makedirs(session)
    os.chmod(session, 0o777)
    try:
        assert session in unsticky_dirs(limit=1 << 20)
        real = sb.mode_works
        for works in (("bwrap", "unshare", "rlimits"), ("unshare", "rlimits")):
            if real(works[0]):
                monkeypatch.setattr(sb, "mode_works", lambda m, works=works: m in works and real(m))
                assert sb.resolve_mode("auto").mode == works[0]  # private /tmp: the session is out of reach
        sb._warn_rlimits_picked.cache_clear()
        monkeypatch.setattr(sb, "mode_works", lambda m: m == "rlimits" and real(m))
        with pytest.warns(UserWarning, match=r"without the sticky bit \(Ray's /tmp/ray/session_\*"):
            assert sb.resolve_mode("auto").mode == "rlimits"
    finally:
        sb._warn_rlimits_picked.cache_clear()
        remove_path(os.path.dirname(session), time.monotonic() + 10)
