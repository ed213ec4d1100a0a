#!/usr/bin/env bash
# The GPU acceptance run in one command: the first thing to run when a GPU is lent (docs/kernels.md and
# docs/decoding.md, "GPU acceptance run").
#
#   bash scripts/gpu_acceptance.sh [OUT.json] [ebpo bench gpu options ...]
#   bash scripts/gpu_acceptance.sh                          # -> gpu_acceptance.json, preset:mini in bf16
#   bash scripts/gpu_acceptance.sh cpu.json --device cpu    # the CPU sizes (what CI runs, tiny preset)
#
# Prints the GPU, then `ebpo bench gpu`'s tables; writes OUT.json after every section, so a run stopped
# early keeps what finished. The run budgets itself to 7 minutes (--budget-s 420); `timeout` stops it
# at 8. Exit status: that of `ebpo bench gpu` (1: a section or a GPU test failed; 124: stopped at 8 min).
set -uo pipefail
cd "$(dirname "$0")/.."
out=gpu_acceptance.json
if [[ $# -gt 0 && "$1" != -* ]]; then
  out=$1
  shift
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
else
  echo "no nvidia-smi on this machine"
fi
timeout --kill-after=30 480 "${PYTHON:-python}" -m ebpo bench gpu --json "$out" "$@"
rc=$?
echo "gpu_acceptance: exit status $rc, results in $out"
exit $rc
