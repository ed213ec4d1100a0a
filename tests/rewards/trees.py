"""Trees built to be hard to remove, for the clean-up tests (test_sandbox_rmtree.py, test_sandbox_cleaner.py):
chains deeper than the recursion limit and PATH_MAX, symbolic links, odd names, FIFOs and sockets, floods."""
import os
import socket


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
