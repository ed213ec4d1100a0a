"""Clean-up finished in the background (rewards/sandbox_cleaner.py), rlimits mode as root: a clean-up that does
not fit in the sample's budget is finished later with the uid held and marked busy, and one that fails never
raises into the sample and never frees the uid."""
import os
import time
import uuid

import pytest

from rewards import sandbox_cleaner
from rewards.sandbox_uids import LOCK_DIR, Slot
from tests.rewards.trees import _wide

ROOT = os.geteuid() == 0


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
