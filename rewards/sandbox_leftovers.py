"""rlimits mode: remove what a sandbox uid left on the host after its sample (files and SysV IPC objects).

Without a mount or IPC namespace, a candidate running as the dedicated sandbox uid can create files in
any directory it may write to (world-writable ones, such as ``/tmp``, and any nested in them, such as a
Ray session directory without the sticky bit) and SysV shared memory segments, message queues and
semaphore sets, all of which outlive its processes. After the sample we remove every such object the uid
owns: IPC objects from ``/proc/sysvipc``, and every entry the uid owns in the world-writable directories
under the temporary roots (a directory it owns goes whole, with what it holds).

Finding those directories costs a walk of the roots; the walk is kept between samples and redone only
where a directory's ctime moved (an entry was added, removed or renamed there, or its mode changed:
ctime cannot be set back by an unprivileged process), so a sample pays one ``lstat`` per directory.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import stat
import threading

ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/dev/mqueue", "/var/lock")
_IPC_RMID = 0


class _Tree:
    """Directories under ROOTS that a stranger uid can reach: path -> (ctime_ns, mode, child dirs)."""

    def __init__(self, roots=ROOTS):
        self.roots, self.dirs, self.lock = roots, {}, threading.Lock()

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

    def refresh(self) -> list[str]:
        """Re-walk where something changed; return the world-writable directories found."""
        with self.lock:
            todo, seen, writable = list(self.roots), set(), []
            while todo:
                path = todo.pop()
                if path in seen:
                    continue
                seen.add(path)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IXOTH:
                    continue  # a stranger cannot get below it
                if st.st_mode & stat.S_IWOTH:
                    writable.append(path)
                known = self.dirs.get(path)
                kids = known[2] if known and known[0] == st.st_ctime_ns else self._scan(path, st)
                todo += kids
            for path in [p for p in self.dirs if p not in seen]:
                del self.dirs[path]
            return writable


_TREE = _Tree()


def remove_files(uid: int, tree: _Tree = _TREE) -> int:
    """Delete every entry ``uid`` owns in the world-writable directories under ROOTS; returns how many."""
    removed = 0
    for d in tree.refresh():
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
                removed += 1
            except OSError:
                pass
    return removed


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


def remove_leftovers(uid: int) -> int:
    """Everything ``uid`` left on the host (files under ROOTS, SysV IPC); returns how many objects."""
    return remove_ipc(uid) + remove_files(uid)
