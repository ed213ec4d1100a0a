"""What the rlimits mode leaves on the host (rewards/sandbox_leftovers.py): hostile trees the candidate builds
under the world-writable directories are gone after the sample and the worker goes on; world-writable
directories without the sticky bit are found, named at start-up, and `auto` prefers a mode that hides them."""
import os
import time
import uuid

import pytest

from rewards import sandbox, sandbox_cleaner
from rewards.code_reward import code_reward
from rewards.sandbox_rmtree import remove_path
from tests.rewards.hostile import MODES

ROOT = os.geteuid() == 0


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
