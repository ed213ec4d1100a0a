"""The jail: where third-party code fed policy text runs outside the sandbox's harness (shared source).

Two users: the judge's test runners (``_judge.py``: dataset test code, which may ``eval`` what the candidate
returns) and the verifier sandbox (``_verifier_server.py``: reasoning-gym's and verifiers' scoring). Both
follow one pattern: a trusted process (root, or root of its own user namespace) sets the jail up once,
then forks one child per job, and the child confines itself (``confine``) before it reads the job.

``setup()`` (the trusted process, once): new mount, network, IPC and UTS namespaces (a user namespace
first when not root: ``enter_user_namespace``), and a jail tree: a fresh tmpfs holding, read-only at their
host paths, only the interpreter, its standard library, its site-packages, the directories of the shared
objects it has mapped and ``/etc/ld.so.cache`` (``visible_paths``). No project files, datasets, home
directories, ``/proc``, or anything writable. Where namespaces are refused (root in a container without
CAP_SYS_ADMIN) the tree is an empty root-owned directory: no files at all. Non-root without user
namespaces: no tree.

``confine(root, uid, ...)`` (the child, before anything untrusted): closes every descriptor but the ones
it keeps, chroots into the tree, becomes ``uid`` (a dedicated unprivileged uid when we are root) with no
supplementary groups, drops every capability (user-namespace case), sets no_new_privs and a parent-death
SIGKILL, and rlimits: address space, CPU seconds, no new process or thread (RLIMIT_NPROC 1: the child
cannot fork, so nothing of it outlives its SIGKILL), no file writes, few descriptors, no core dump.

Standard library only, no ``from __future__`` (this source is concatenated in front of others).
"""
import ctypes
import os
import resource
import signal
import sys
import sysconfig

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 1 << 14, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_SYS_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442}.get(os.uname().machine)
_MOUNT_ATTR_RDONLY, _AT_RECURSIVE = 0x1, 0x8000
_MOUNT_POINTS = ("/mnt", "/srv", "/media", "/opt", "/home", "/var", "/run", "/tmp")
JAIL_TMPFS_BYTES = 1 << 20


class JailError(OSError):
    """The jail could not be set up (the caller falls back to a weaker mode, and says so)."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise JailError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(src, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc().mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount " + target)


def enter_user_namespace():
    """Non-root only, before any thread starts: a new user namespace where we are root (capabilities in it
    only; on the host we stay our own uid). Raises JailError when user namespaces are not allowed."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc().unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def visible_paths():
    """What a jailed copy of this interpreter needs to see (real paths): the interpreter binary, its
    standard library and site-packages, the directories of every shared object mapped now, ld.so.cache."""
    paths = {os.path.realpath(sys.executable), "/etc/ld.so.cache"}
    sp = sysconfig.get_paths()
    for p in [sp.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")] + list(sys.path):
        if p and (p in sp.values() or p.endswith(("lib-dynload", "site-packages", "dist-packages"))):
            paths.add(os.path.realpath(p))
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/") and not parts[5].startswith(("/dev/", "/proc/")):
                    paths.add(os.path.dirname(os.path.realpath(parts[5].strip())))
    except OSError:
        pass
    return sorted(p for p in paths if os.path.exists(p) and p != "/")


def _mirror(root, path, binds, depth=0):
    """Make ``path`` reachable in ``root`` as on the host: each symlink on the way recreated, the real end
    recorded in ``binds``."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts)):
        cur = "/" + "/".join(parts[:i + 1])
        if os.path.islink(cur) and depth < 16:
            target, link = os.readlink(cur), root + cur
            if not os.path.lexists(link):
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(target, link)
            resolved = os.path.normpath(os.path.join(os.path.dirname(cur), target))
            return _mirror(root, "/".join([resolved] + parts[i + 1:]), binds, depth + 1)
    binds.add(os.path.normpath("/" + "/".join(parts)))


def _read_only(target):
    """Make the bind mount at ``target`` read-only, submounts included, leaving its other flags as they are
    (in a user namespace they are locked)."""
    if _SYS_MOUNT_SETATTR is not None:
        attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)
        libc = _libc()
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(_SYS_MOUNT_SETATTR, -100, target.encode(), _AT_RECURSIVE, ctypes.byref(attr), 32) == 0:
            return
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    st = os.statvfs(target)
    for st_flag, ms_flag in ((getattr(os, "ST_NOEXEC", 8), 8), (getattr(os, "ST_NOATIME", 1024), 1024),
                             (getattr(os, "ST_NODIRATIME", 2048), 2048), (getattr(os, "ST_RELATIME", 4096), 1 << 21)):
        if st.f_flag & st_flag:
            flags |= ms_flag
    _mount(None, target, None, flags)


def _build_tree(paths):
    """A read-only tmpfs at a mount point that hides none of ``paths``, holding ``paths`` bound read-only."""
    point = next((m for m in _MOUNT_POINTS if os.path.isdir(m) and not os.path.islink(m)
                  and not any(p == m or p.startswith(m + "/") for p in paths)), None)
    if point is None:
        raise JailError(0, "no mount point for the jail tree")
    _mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=0755" % JAIL_TMPFS_BYTES)
    old = os.umask(0o022)
    try:
        for top in sorted(os.listdir("/")):  # /lib -> usr/lib and friends (merged-usr systems)
            if os.path.islink("/" + top):
                os.symlink(os.readlink("/" + top), point + "/" + top)
        binds = set()
        for p in paths:
            _mirror(point, p, binds)
        binds = sorted(b for b in binds if not any(b.startswith(o + "/") for o in binds if o != b))
        for b in binds:
            target = point + b
            if os.path.isdir(b):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
            _mount(b, target, None, MS_BIND | MS_REC)
            _read_only(target)
        for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):  # optional: some libraries open them
            try:
                os.makedirs(point + "/dev", exist_ok=True)
                open(point + dev, "a").close()
                _mount(dev, point + dev, None, MS_BIND)
            except OSError:
                pass
    finally:
        os.umask(old)
    _mount(None, point, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return point


def _empty_root():
    """An empty directory only root can write to (the tree where namespaces are refused)."""
    import tempfile
    d = tempfile.mkdtemp(prefix="ebpo-jail-")
    os.chmod(d, 0o555)
    return d


def setup(paths=None, empty_root=None):
    """Set the jail up in this (trusted) process: returns ``(mode, root)``. ``namespaces``: own mount,
    network, IPC and UTS namespaces and a read-only tree of ``paths`` (default ``visible_paths()``);
    ``chroot``: root without namespaces, an empty tree (``empty_root``, else a new directory the caller
    removes; the network stays open); ``none``: neither (non-root without user namespaces). Call
    ``enter_user_namespace`` first when not root."""
    paths = visible_paths() if paths is None else paths
    try:
        _check(_libc().unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        return "namespaces", _build_tree(paths)
    except (JailError, OSError):
        if os.geteuid() == 0 and not _in_user_namespace():
            return "chroot", empty_root or _empty_root()
        return "none", None


def _in_user_namespace():
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() != ["0", "0", "4294967295"]
    except OSError:
        return False


def _drop_capabilities(libc):
    for cap in range(64):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)())


def confine(root, uid, keep_fds, memory_bytes, cpu_s, open_files=16):
    """Confine this (freshly forked, single-threaded) process before it touches anything untrusted: see the
    module docstring. ``root``: the jail tree (None: stay where we are); ``uid``: become it (only as
    root; None: keep ours); ``keep_fds``: descriptors to keep (0-2 become /dev/null); ``memory_bytes``,
    ``cpu_s``: RLIMIT_AS and RLIMIT_CPU (None: unchanged). Raises on failure:
    a child that cannot be confined must not run the job."""
    libc = _libc()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd not in keep_fds:
            os.dup2(null, fd)
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = range(3, 4096)
    for fd in fds:
        if fd > 2 and fd not in keep_fds:
            try:
                os.close(fd)
            except OSError:
                pass
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if root is not None:
        os.chroot(root)
        os.chdir("/")
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _drop_capabilities(libc)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for res, val in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_NPROC, 1),
                     (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_NOFILE, open_files), (resource.RLIMIT_CORE, 0)):
        if val is not None:  # None: that limit stays as it is
            resource.setrlimit(res, (val, val))
    if uid is not None and os.geteuid() == 0:
        raise JailError(0, "still root after dropping to the sandbox uid")


def address_space_bytes():
    """This process's current virtual size (a fork's RLIMIT_AS must leave room above it)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def non_dumpable():
    """No same-uid process may ptrace us or open /proc/<us>/{mem,fd,environ}."""
    try:
        _libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:
        pass
