#!/usr/bin/env bash
# Installs ebpo on a fresh machine, from the tested dependency set (requirements/lock.txt) by default.
#   bash install.sh              core package, every dependency at its locked (tested) version
#   bash install.sh --test       plus the test tools (pytest, hypothesis, ruff, import-linter), locked as well
#   bash install.sh --no-lock    the newest versions pyproject.toml allows instead of the lock, for a
#                                stack that fixes some versions itself (also EBPO_NO_LOCK=1)
#   EBPO_KEEP_TORCH=1 bash install.sh   keep the torch already installed (a CUDA build on a GPU machine);
#                                the lock's other versions still apply
# torch is pinned to the locked version so pip takes the local CPU wheel where there is one instead of
# several GB of CUDA packages. Best effort: installs bubblewrap (the code-reward sandbox) with apt when
# running as root; without it the code reward's sandbox=auto uses unshare (util-linux) when that works,
# else rlimits only (docs/rewards.md).
set -euo pipefail
cd "$(dirname "$0")"
extras=""
use_lock=1
[ "${EBPO_NO_LOCK:-0}" = 1 ] && use_lock=0
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        --no-lock) use_lock=0 ;;
        *) echo "install.sh: unknown option '$arg' (allowed: --test, --no-lock)" >&2; exit 2 ;;
    esac
done
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
        || echo "install.sh: bubblewrap not installed; code rewards fall back to unshare (util-linux, where user" \
                "namespaces work; the host file system stays visible), else to rlimits-only sandboxing" >&2
fi
lock=requirements/lock.txt
torch_version="$(sed -n 's/^torch==//p' "$lock")"
args=()
if [ "$use_lock" = 1 ]; then
    if [ "${EBPO_KEEP_TORCH:-0}" = 1 ]; then
        # the lock minus torch: the installed CUDA torch stays, everything else is the tested set
        constraints="$(mktemp)"
        trap 'rm -f "$constraints"' EXIT
        grep -v '^torch==' "$lock" > "$constraints"
        args+=(-c "$constraints")
    else
        args+=(-c "$lock" "torch==$torch_version")
    fi
    echo "install.sh: installing the tested set ($lock; --no-lock for the newest allowed versions)" >&2
else
    [ "${EBPO_KEEP_TORCH:-0}" = 1 ] || args+=("torch==$torch_version")
    echo "install.sh: installing without the lock: the newest versions pyproject.toml allows" >&2
fi
pip install -q "${args[@]}" -e ".${extras}"
