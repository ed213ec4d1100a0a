#!/usr/bin/env bash
# Catches upstream drift early: builds a throw-away virtual environment with the NEWEST versions
# pyproject.toml allows (no lock), prints every version that differs from requirements/lock.txt, and runs
# the drift smoke (tests/smoke: model forward + cache + save/load, one decode, one reward of each kind,
# one learner update with two gloo ranks, one RL step through Ray), step by step, naming each that fails.
#
#   bash scripts/check-latest.sh         exit 0 when every step passes, 1 when one fails
#
# torch is held at the locked version (the CPU build here) unless CHECK_LATEST_TORCH=1: the newest torch
# on the package index is a CUDA build of several GB. KEEP_VENV=DIR reuses/keeps the environment in DIR.
# When it fails: support the new release, or cap it in pyproject.toml with a comment naming the release
# that breaks us (README, Development).
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
python="${PYTHON:-python3}"
if [ -n "${KEEP_VENV:-}" ]; then
    venv="$KEEP_VENV"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    venv="$work/venv"
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || exit 1
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip >/dev/null 2>&1
torch_spec="torch==$(sed -n 's/^torch==//p' requirements/lock.txt)"
[ "${CHECK_LATEST_TORCH:-0}" = 1 ] && torch_spec="torch"
echo "check-latest: installing the newest allowed versions (torch: $torch_spec)..."
# (pip's notes about index locations that this machine lacks are noise here: filtered out)
if ! "${pip[@]}" install -q --upgrade --upgrade-strategy eager "$torch_spec" ".[test]" 2> >(grep -v "is ignored: it is neither" >&2); then
    echo "check-latest: FAILED: the newest allowed versions do not install together"
    exit 1
fi
echo
echo "versions that differ from requirements/lock.txt:"
"${pip[@]}" freeze --exclude-editable --all 2>/dev/null | "$venv/bin/python" scripts/lock_diff.py requirements/lock.txt
echo
# one named step per smoke test; each runs on its own so that a failure names its step
steps=(
    "model forward, KV cache, save/load|test_model_forward_cache_and_save_load"
    "decode (shipped tiny-sft)|test_decode_shipped_model"
    "rewards: math, code, format, decode_cost|test_one_reward_of_each_kind"
    "learner update, W=2 over gloo|test_learner_update_two_ranks_gloo"
    "RL step through Ray|test_rl_step_through_ray"
)
failed=()
results=()
for step in "${steps[@]}"; do
    name="${step%%|*}"
    test="${step##*|}"
    start=$SECONDS
    log="$(mktemp)"
    if (cd "$repo" && PYTHONPATH="$repo" WANDB_MODE=offline "$venv/bin/python" -m pytest -q -m smoke \
            "tests/smoke/test_smoke.py::$test" -p no:cacheprovider >"$log" 2>&1); then
        results+=("  PASS  $(printf '%-42s' "$name") $((SECONDS - start)) s")
    else
        results+=("  FAIL  $(printf '%-42s' "$name") $((SECONDS - start)) s")
        failed+=("$name")
        echo "---- $name: the last lines of its output ----"
        tail -n 40 "$log"
        echo "----"
    fi
    rm -f "$log"
done
echo "drift smoke with the newest allowed versions:"
printf '%s\n' "${results[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "check-latest: FAILED at: $(IFS=';'; echo "${failed[*]}")"
    echo "check-latest: support the new release, or cap it in pyproject.toml with a comment naming it."
    exit 1
fi
echo "check-latest: passed"
