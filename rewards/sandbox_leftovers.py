"""rlimits mode: remove what a sandbox uid left on the host after its sample (files and SysV IPC objects).

Without a mount or IPC namespace, a candidate running as the dedicated sandbox uid can create files in
any directory it may write to (world-writable ones, such as ``/tmp``, and any nested in them, such as a
Ray session directory without the sticky bit) and SysV shared memory segments, message queues and
semaphore sets, all of which outlive its processes. After the sample we remove every such object the uid
owns: IPC objects from ``/proc/sysvipc``, and every entry the uid owns in the world-writable directories
under the temporary roots (a directory it owns goes whole, with what it holds).

Finding those directories costs a walk of the roots; the walk is kept between samples and redone only
where a directory's ctime moved (an entry was added, removed or renamed there, or its mode changed:
ctime cannot be set back by an unprivileged process), so a sample pays one ``lstat`` per directory. It
never goes below a directory that a sandbox uid owns: that one goes whole with its owner's clean-up, and
a candidate's flood of directories would otherwise be walked at every sample.

The removal has a deadline (the caller's budget) and takes any tree the uid can build (a chain deeper
than the recursion limit or PATH_MAX, a flood of inodes, symbolic links anywhere: sandbox_rmtree); it
reports whether it finished, so that a uid is never handed out again with something of it left.

What this cannot undo: without a mount namespace, a world-writable directory *without the sticky bit*
(Ray's ``/tmp/ray/session_*`` directories on a normal host) lets the candidate delete or rename other
users' entries in it; only ``bwrap``/``unshare`` (private ``/tmp``) stop that. ``unsticky_dirs`` lists
them for the start-up warning.
"""
from __future__ import annotations

import ctypes
import os
import stat
import threading
import time

from rewards.sandbox_rmtree import remove_entry

ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/dev/mqueue", "/var/lock")
_IPC_RMID = 0


class _Tree:
    """Directories under ROOTS that a stranger uid can reach: path -> (ctime_ns, mode, child dirs)."""

    def __init__(self, roots=ROOTS):
        self.roots, self.dirs, self.lock = roots, {}, threading.Lock()
        self.unsticky: list[str] = []  # world-writable directories without the sticky bit (last walk)

    def _scan(self, path: str, st) -> list:
        kids = []
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            kids.append(e.path)
                    except OSError:
                        pass
        except OSError:
            pass
        self.dirs[path] = (st.st_ctime_ns, st.st_mode, kids)
        return kids

    def refresh(self, skip_owners=()) -> list[str]:
        """Re-walk where something changed; return the world-writable directories found, not going below
        a directory owned by a uid in ``skip_owners`` (the sandbox range: those go whole)."""
        with self.lock:
            todo, seen, writable = list(self.roots), set(), []
            self.unsticky = []
            while todo:
                path = todo.pop()
                if path in seen:
                    continue
                seen.add(path)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IXOTH or st.st_uid in skip_owners:
                    continue  # a stranger cannot get below it, or it is a sandbox's own (removed whole)
                if st.st_mode & stat.S_IWOTH:
                    writable.append(path)
                    if not st.st_mode & stat.S_ISVTX:
                        self.unsticky.append(path)
                known = self.dirs.get(path)
                kids = known[2] if known and known[0] == st.st_ctime_ns else self._scan(path, st)
                todo += kids
            for path in [p for p in self.dirs if p not in seen]:
                del self.dirs[path]
            return writable


_TREE = _Tree()


def remove_files(uid: int, deadline: float = float("inf"), tree: _Tree = _TREE,
                 skip_owners=()) -> tuple[int, bool]:
    """Delete every entry ``uid`` owns in the world-writable directories under ROOTS, until ``deadline``
    (``time.monotonic()`` seconds); returns (how many, whether everything went)."""
    removed, complete = 0, True
    for d in tree.refresh(skip_owners):
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            with os.scandir(dfd) as it:
                mine = [e.name for e in it if _owner(e) == uid]
            for name in mine:
                if time.monotonic() > deadline:
                    return removed, False
                if remove_entry(dfd, name, deadline):
                    removed += 1
                else:
                    complete = False
        except OSError:
            complete = False
        finally:
            os.close(dfd)
    return removed, complete


def _owner(entry) -> int | None:
    try:
        return entry.stat(follow_symlinks=False).st_uid
    except OSError:
        return None


def unsticky_dirs(limit: int = 5) -> list[str]:
    """World-writable directories without the sticky bit under ROOTS (up to ``limit``): in ``rlimits``
    mode a candidate can delete or rename other users' entries there."""
    _TREE.refresh()
    return sorted(_TREE.unsticky)[:limit]


def _ipc_ids(kind: str, uid: int) -> list[int]:
    """Ids of the SysV IPC objects of ``kind`` (shm, msg, sem) that ``uid`` owns or created."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            head, *rows = f.read().splitlines()
    except OSError:
        return []
    cols = head.split()
    ids = []
    for row in rows:
        vals = dict(zip(cols, row.split()))
        try:
            if int(vals.get("uid", -1)) == uid or int(vals.get("cuid", -1)) == uid:
                ids.append(int(vals[{"shm": "shmid", "msg": "msqid", "sem": "semid"}[kind]]))
        except (KeyError, ValueError):
            pass
    return ids


def remove_ipc(uid: int) -> int:
    """Remove ``uid``'s SysV shared memory segments, message queues and semaphore sets; returns how many
    (a segment still attached is destroyed when its last process detaches: they are all dead by now)."""
    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for kind, call in (("shm", lambda i: libc.shmctl(i, _IPC_RMID, None)),
                       ("msg", lambda i: libc.msgctl(i, _IPC_RMID, None)),
                       ("sem", lambda i: libc.semctl(i, 0, _IPC_RMID))):
        for ident in _ipc_ids(kind, uid):
            removed += call(ident) == 0
    return removed


def remove_leftovers(uid: int, deadline: float = float("inf"), skip_owners=()) -> tuple[int, bool]:
    """Everything ``uid`` left on the host (SysV IPC, files under ROOTS) until ``deadline``
    (``time.monotonic()`` seconds); returns (how many objects, whether everything went). Never raises:
    a clean-up that fails is reported as unfinished, so the uid is not handed out as clean."""
    try:
        n_ipc = remove_ipc(uid)
        n_files, complete = remove_files(uid, deadline, skip_owners=skip_owners)
        return n_ipc + n_files, complete
    except Exception:  # e.g. MemoryError: unfinished, retried later, never "free"
        return 0, False
