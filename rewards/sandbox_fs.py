"""What the sandbox's interpreter needs to see, and nothing else.

``interpreter_info`` runs the sandbox interpreter once (outside any sandbox, under the sandbox uid) with a
trusted script that reports its version, its standard library and every shared object it maps after
importing all of its C extension modules. ``bwrap_binds`` turns that into bubblewrap arguments: the
interpreter binary, its standard library (with any site-packages inside it hidden), the shared objects
and the symlinks the dynamic loader follows to reach them, and the site-packages the caller allows.
Project files, datasets, home directories and the rest of the host file system are not mounted.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess

MIN_PYTHON = (3, 9)  # the harness needs os.waitstatus_to_exitcode and os.memfd_create

_INFO_SCRIPT = r"""
import importlib, json, os, sys, sysconfig
paths = sysconfig.get_paths()
dynload = [p for p in sys.path if p.endswith("lib-dynload") and os.path.isdir(p)]
for d in dynload:
    for name in sorted(os.listdir(d)):
        if name.endswith(".so") and not name.startswith(("_test", "xx", "_xx", "_ctypes_test")):
            try:
                importlib.import_module(name.split(".")[0])
            except Exception:
                pass
maps = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            maps.add(parts[5].strip())
print(json.dumps({"version": list(sys.version_info[:3]), "implementation": sys.implementation.name,
                  "executable": os.path.realpath(sys.executable), "stdlib": paths["stdlib"],
                  "platstdlib": paths["platstdlib"], "site": [paths["purelib"], paths["platlib"]],
                  "sys_path": sys.path, "maps": sorted(maps)}))
"""


class InterpreterError(RuntimeError):
    """The sandbox interpreter cannot run the harness (missing, not Python 3, too old)."""


@dataclasses.dataclass(frozen=True)
class InterpreterInfo:
    """The sandbox interpreter as it reports itself."""

    path: str                  # as configured (may be a symlink)
    executable: str            # real path of the binary
    version: tuple
    stdlib: tuple              # standard library directories (stdlib, platstdlib, lib-dynload)
    site_inside_stdlib: tuple  # site-packages directories that live inside a stdlib directory (hidden)
    maps: tuple                # every file the interpreter mapped: binary, loader, shared objects


@functools.lru_cache(maxsize=None)
def interpreter_info(python: str, uid: int | None) -> InterpreterInfo:
    """Run ``python`` (as ``uid`` when given) with the info script; raise InterpreterError with the reason
    when it does not start or is not a Python >= MIN_PYTHON."""
    kwargs = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        out = subprocess.run([python, "-I", "-B", "-c", _INFO_SCRIPT], capture_output=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, cwd="/", **kwargs)
        data = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        detail = getattr(locals().get("out"), "stderr", b"") or b""
        raise InterpreterError(f"the sandbox interpreter {python!r} does not run here: {type(e).__name__}: "
                               f"{e} {detail.decode('utf-8', 'replace')[-300:]}".strip()) from e
    version = tuple(data["version"])
    if data.get("implementation") != "cpython" or version[:2] < MIN_PYTHON:
        raise InterpreterError(
            f"the sandbox interpreter {python!r} is {data.get('implementation')} "
            f"{'.'.join(map(str, version))}; the code reward's harness needs CPython >= "
            f"{'.'.join(map(str, MIN_PYTHON))}. Make a newer python3 executable by the sandbox uid "
            "(e.g. install the system python3, or chmod o+rx the directories leading to this project's "
            "interpreter).")
    stdlib = {data["stdlib"], data["platstdlib"]} | {p for p in data["sys_path"] if p.endswith("lib-dynload")}
    stdlib = {os.path.realpath(p) for p in stdlib if os.path.isdir(p)}
    site = {os.path.realpath(p) for p in data["site"] + data["sys_path"] if p.endswith(("site-packages",
                                                                                         "dist-packages"))}
    inside = tuple(sorted(p for p in site if os.path.isdir(p) and any(p.startswith(s + os.sep) for s in stdlib)))
    return InterpreterInfo(python, data["executable"], version, tuple(sorted(stdlib)), inside, tuple(data["maps"]))


class _Binds:
    """bwrap arguments, each path mounted or linked once, in an order bwrap accepts."""

    def __init__(self):
        self.args: list[str] = []
        self.done: set[str] = set()

    def symlink(self, link: str, target: str) -> None:
        if link not in self.done:
            self.done.add(link)
            self.args += ["--symlink", target, link]

    def bind(self, path: str) -> None:
        if path not in self.done:
            self.done.add(path)
            self.args += ["--ro-bind", path, path]

    def mirror(self, path: str, depth: int = 0) -> None:
        """Make ``path`` reachable inside as on the host: recreate each symlink on the way, bind the end."""
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts)):
            cur = "/" + "/".join(parts[:i + 1])
            if os.path.islink(cur) and depth < 16:
                target = os.readlink(cur)
                self.symlink(cur, target)
                resolved = os.path.normpath(os.path.join(os.path.dirname(cur), target))
                rest = "/".join(parts[i + 1:])
                return self.mirror(resolved + ("/" + rest if rest else ""), depth + 1)
        if os.path.exists(path):
            self.bind(os.path.normpath(path))


@functools.lru_cache(maxsize=None)
def _dir_links(directory: str) -> dict:
    """realpath -> [symlinks] for one library directory (scanned once per process)."""
    out: dict = {}
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.is_symlink():
                    out.setdefault(os.path.realpath(entry.path), []).append(entry.path)
    except OSError:
        pass
    return out


def _elf_interp(path: str) -> str | None:
    """PT_INTERP of a 64/32-bit little-endian ELF binary (the dynamic loader's path), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return None
            is64 = head[4] == 2
            phoff = int.from_bytes(head[32:40] if is64 else head[28:32], "little")
            entsize = int.from_bytes(head[54:56] if is64 else head[42:44], "little")
            count = int.from_bytes(head[56:58] if is64 else head[44:46], "little")
            for k in range(count):
                f.seek(phoff + k * entsize)
                ph = f.read(entsize)
                if int.from_bytes(ph[:4], "little") == 3:  # PT_INTERP
                    off = int.from_bytes(ph[8:16] if is64 else ph[4:8], "little")
                    size = int.from_bytes(ph[32:40] if is64 else ph[16:20], "little")
                    f.seek(off)
                    return f.read(size).rstrip(b"\0").decode()
    except (OSError, ValueError):
        return None
    return None


@functools.lru_cache(maxsize=None)
def bwrap_binds(info: InterpreterInfo, site_packages: tuple = ()) -> tuple:
    """bubblewrap arguments that show the interpreter, its standard library, its shared objects and the
    allowed ``site_packages`` directories, read-only, at their host paths; nothing else of the host."""
    b = _Binds()
    for top in sorted(os.listdir("/")):  # /lib -> usr/lib and friends (merged-usr systems)
        if os.path.islink("/" + top):
            b.symlink("/" + top, os.readlink("/" + top))
    b.mirror(info.executable)
    b.mirror("/etc/ld.so.cache")  # where the dynamic loader looks first (a list of library paths)
    interp = _elf_interp(info.executable)
    if interp:
        b.mirror(interp)
    for d in info.stdlib:
        if not any(d.startswith(o + os.sep) for o in info.stdlib):
            b.mirror(d)
    for m in info.maps:
        if any(m.startswith(s + os.sep) for s in info.stdlib) or not os.path.isfile(m):
            continue
        b.mirror(m)
        for link in _dir_links(os.path.dirname(m)).get(os.path.realpath(m), []):
            b.symlink(link, os.readlink(link))
    for d in info.site_inside_stdlib:  # e.g. <prefix>/lib/python3.11/site-packages: hidden by an empty tmpfs
        b.args += ["--size", str(1 << 20), "--tmpfs", d]
    for d in site_packages:
        real = os.path.realpath(d)
        if not os.path.isdir(real):
            raise FileNotFoundError(f"code reward: site_packages entry {d!r} is not a directory")
        b.mirror(real)
    return tuple(b.args)
