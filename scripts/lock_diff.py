"""Prints the packages whose installed version differs from requirements/lock.txt.

    pip freeze | python scripts/lock_diff.py [requirements/lock.txt]

Used by scripts/check-latest.sh; exit status 0 always (a difference is information, not a failure).
"""
import re
import sys

SKIP = {"ebpo", "pip", "setuptools", "wheel"}


def versions(lines) -> dict[str, str]:
    """name (normalised) -> version of every `name==version` line; local labels (+cpu) dropped."""
    out = {}
    for line in lines:
        m = re.match(r"([A-Za-z0-9_.-]+)==([^+\s]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def main() -> int:
    lock_path = sys.argv[1] if len(sys.argv) > 1 else "requirements/lock.txt"
    with open(lock_path) as f:
        lock = versions(f)
    installed = versions(sys.stdin)
    rows = [(name, lock.get(name, "(not in lock)"), version) for name, version in sorted(installed.items())
            if name not in SKIP and lock.get(name) != version]
    rows += [(name, lock[name], "(not installed)") for name in sorted(set(lock) - set(installed))]
    for name, old, new in rows:
        print(f"  {name:28s} {old:>16s} -> {new}")
    print(f"  ({len(rows)} differ)" if rows else "  none: the lock is the newest allowed set")
    return 0


if __name__ == "__main__":
    sys.exit(main())
