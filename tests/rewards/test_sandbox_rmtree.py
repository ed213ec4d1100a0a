"""Removing a tree a sandbox built (rewards/sandbox_rmtree.py): any shape goes, without recursion and without
following a link, and the removal keeps its deadline and goes on from there at the next call."""
import os
import time
import uuid

import pytest

from rewards.sandbox_rmtree import remove_path
from tests.rewards.trees import _chain, _odd, _wide, _with_links


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
