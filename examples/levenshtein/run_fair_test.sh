#!/usr/bin/env bash
# The whole fair test of Levenshtein editing (issue 36; docs/levenshtein_fair_test.md), on the Squeeze task, one seed per call:
#   bash examples/levenshtein/run_fair_test.sh start            # stage 1 + the gate (runs/fair/start, start.json)
#   bash examples/levenshtein/run_fair_test.sh seed 0           # stages 2 and 3 for seed 0 (seeds run in parallel)
#   python examples/levenshtein/fair_test.py table --start runs/fair/start.json control-s0=runs/fair/control-s0 ...
# Stage 2 trains in chunks of CHUNK steps, both arms alike, until the Levenshtein model's held-out DELETE / INSERT
# label accuracy on the start's own wrong answers is >= 0.8 or MAX_CHUNKS chunks are done.
set -euo pipefail
R=${R:-runs/fair}
START=${START:-$R/start}
CHUNK=${CHUNK:-100}
MAX_CHUNKS=${MAX_CHUNKS:-3}
RL_STEPS=${RL_STEPS:-20}
FT="python examples/levenshtein/fair_test.py"

if [ "$1" = start ]; then
  # stage 0: copy, from tiny-sft (the first task; it failed the gate); stage 1: Squeeze, from the copy model
  [ -d "$R/copy" ] || ebpo train recipes/sft_tiny_lev_fair.yaml trainer.run_dir="$R/copy-run" trainer.export_dir="$R/copy"
  # three 1,000-step runs of the Squeeze recipe, each from the last (seeds 0, 1, 2; a fresh warm-up each)
  prev=$R/copy
  for k in 0 1 2; do
    out=$R/squeeze$k; [ "$k" = 2 ] && out=$START
    [ -d "$out" ] || ebpo train recipes/sft_tiny_lev_fair_squeeze.yaml model="$prev" trainer.seed=$k \
      trainer.run_dir="$out-run" trainer.export_dir="$out"
    prev=$out
  done
  $FT gate "$START" --out "$R/start.json"
  exit 0
fi

s=$2
lev=$START; ctl=$START
for c in $(seq 1 "$MAX_CHUNKS"); do  # a chunk already exported (and its labels) is kept: a rerun with more chunks goes on
  [ -d "$R/lev-s$s-c$c" ] || ebpo train recipes/sft_tiny_lev_fair_lev.yaml model="$lev" trainer.seed=$((100 * s + c)) \
    trainer.steps="$CHUNK" trainer.run_dir="$R/lev-s$s-c$c-run" trainer.export_dir="$R/lev-s$s-c$c"
  [ -d "$R/control-s$s-c$c" ] || ebpo train recipes/sft_tiny_lev_fair_lev.yaml model="$ctl" objective.lev_weight=0 \
    trainer.seed=$((100 * s + c)) trainer.steps="$CHUNK" trainer.run_dir="$R/control-s$s-c$c-run" \
    trainer.export_dir="$R/control-s$s-c$c"
  lev=$R/lev-s$s-c$c; ctl=$R/control-s$s-c$c
  [ -s "$R/labels-s$s-c$c.json" ] || $FT labels "$lev" --start "$R/start.json" > "$R/labels-s$s-c$c.json"
  cat "$R/labels-s$s-c$c.json"
  python -c "import json,sys; a=json.load(open(sys.argv[1]))['own_edit_acc']; sys.exit(0 if a >= 0.8 else 1)" \
    "$R/labels-s$s-c$c.json" && break
done
ln -sfn "$(basename "$lev")" "$R/lev-s$s"; ln -sfn "$(basename "$ctl")" "$R/control-s$s"
ebpo train recipes/rl_tiny_lev_fair.yaml model="$R/lev-s$s" trainer.seed="$s" trainer.steps="$RL_STEPS" \
  trainer.run_dir="$R/rl-lev-s$s"
ebpo train recipes/rl_tiny_lev_fair.yaml model="$R/control-s$s" learner.levenshtein=false trainer.seed="$s" \
  trainer.steps="$RL_STEPS" trainer.run_dir="$R/rl-control-s$s"
ebpo export "$R/rl-lev-s$s" "$R/rl-lev-s$s-hf" --dtype fp32
ebpo export "$R/rl-control-s$s" "$R/rl-control-s$s-hf" --dtype fp32
