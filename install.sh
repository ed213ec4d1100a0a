#!/usr/bin/env bash
# Installs ebpo on a fresh machine.
#   bash install.sh          core package (CPU torch 2.13.0 from the local wheel folder when present)
#   bash install.sh --test   plus the test tools
# Best effort: installs bubblewrap (the code-reward sandbox) with apt when running as root; without it the
# code reward's sandbox=auto uses unshare (util-linux) when that works, else rlimits only (docs/rewards.md).
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
        || echo "install.sh: bubblewrap not installed; code rewards fall back to unshare (util-linux, where user" \
                "namespaces work; the host file system stays visible), else to rlimits-only sandboxing" >&2
fi
# Pinning torch here makes pip take the local CPU wheel instead of a multi-GB CUDA build; a GPU
# machine that already has a CUDA torch in the supported range keeps it (EBPO_KEEP_TORCH=1).
if [ "${EBPO_KEEP_TORCH:-0}" = 1 ]; then
    pip install -q -e ".${extras}"
else
    pip install -q torch==2.13.0 -e ".${extras}"
fi
