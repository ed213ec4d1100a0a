"""Remove a tree that a sandbox built, whatever its shape, within a deadline.

``shutil.rmtree`` recurses once per directory level (a 3,000-deep chain raises RecursionError, which
``ignore_errors`` does not cover), joins paths (a chain deeper than PATH_MAX, 4096 bytes, cannot be
named) and has no deadline (a flood of inodes costs as long as it took to make). Here: one loop with
an explicit stack, every operation relative to a directory descriptor (``unlink``/``rmdir``/``open``
with ``dir_fd``, never following a symbolic link), one descriptor held at a time (the way back up is
``..``, checked against the device and inode recorded on the way down, so a directory moved meanwhile
is left alone rather than followed), each directory read once, and the deadline checked every few
hundred entries. What is left when the deadline comes stays for the next call, which goes on from there.
"""
from __future__ import annotations

import errno
import os
import time

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHECK_EVERY = 256  # entries between two looks at the clock


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _unlink_or_dir(name: str, dir_fd: int) -> bool | None:
    """Unlink a non-directory: True done (or already gone), None it is a directory, False it cannot go."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        return None if e.errno in (errno.EISDIR, errno.EPERM) else False  # Linux: EISDIR; POSIX: EPERM


def _empty_dir(cur: int, deadline: float) -> tuple[list[str], bool, bool]:
    """One pass over directory ``cur``: unlink what is not a directory, rmdir empty directories.
    Returns (subdirectories still holding something, something could not be removed, out of time)."""
    full, stuck, n = [], False, 0
    try:
        with os.scandir(cur) as it:
            for e in it:
                n += 1
                if n % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                    return full, stuck, True
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if not is_dir:
                    done = _unlink_or_dir(e.name, cur)
                    if done is True:
                        continue
                    if done is False:
                        stuck = True
                        continue
                try:
                    os.rmdir(e.name, dir_fd=cur)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                        full.append(e.name)
                    else:
                        stuck = True
    except OSError:
        stuck = True
    return full, stuck, False


def remove_entry(parent_fd: int, name: str, deadline: float) -> bool:
    """Remove ``name`` in the directory ``parent_fd`` and everything below it, without following symbolic
    links and without recursion. True when it is gone; False when the deadline (``time.monotonic()``
    seconds) came first or something could not be removed (what is left stays)."""
    done = _unlink_or_dir(name, parent_fd)
    if done is not None:
        return done
    try:
        cur = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # frames from the top down: (name in its parent, (dev, ino) of the parent, subdirectories still to do)
    stack = [(name, _ident(parent_fd), None)]
    stuck = False
    try:
        while True:
            name_here, parent_id, todo = stack[-1]
            if todo is None:  # first visit: one pass over it
                full, failed, late = _empty_dir(cur, deadline)
                stuck = stuck or failed
                if late:
                    return False
                todo = full
                stack[-1] = (name_here, parent_id, todo)
            if time.monotonic() > deadline:
                return False
            if todo:  # down into the next subdirectory that still holds something
                sub = todo.pop()
                try:
                    nxt = os.open(sub, _DIR_FLAGS, dir_fd=cur)
                except FileNotFoundError:
                    continue
                except OSError:
                    stuck = True
                    continue
                here = _ident(cur)
                os.close(cur)
                cur = nxt
                stack.append((sub, here, None))
                continue
            stack.pop()  # everything below is done: up, and remove this directory
            if not stack:
                try:
                    os.rmdir(name_here, dir_fd=parent_fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    return False
                return not stuck
            up = os.open("..", _DIR_FLAGS, dir_fd=cur)
            os.close(cur)
            cur = up
            if _ident(cur) != parent_id:  # moved while we were below: leave it
                return False
            try:
                os.rmdir(name_here, dir_fd=cur)
            except FileNotFoundError:
                pass
            except OSError:
                stuck = True
    except OSError:
        return False
    finally:
        os.close(cur)


def remove_path(path: str, deadline: float) -> bool:
    """``remove_entry`` for a path (its parent opened without following a final symbolic link)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        fd = os.open(parent or "/", _DIR_FLAGS)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return remove_entry(fd, name, deadline)
    finally:
        os.close(fd)
