#!/usr/bin/env bash
# Exploratory: groups with nothing to learn from (train.py --uniform-groups), composed with PODS, on a CPU
# (reproduce/uniform-groups/README.md). The reproduction's task and settings (arith:2, 4 prompts a step, 32 new
# tokens, LR 3e-4 constant, bfloat16 autocast), 10 minutes of training a run, a checkpoint every 2 minutes:
#   pods-keep     PODS max-variance n=8 m=4, uniform groups kept (the paper)
#   pods-refill   the same, uniform groups left out and the step refilled (DAPO's dynamic sampling)
#   grpo-refill   GRPO n=8, refilled (DAPO's dynamic sampling alone)
#   grpo-keep     GRPO n=8 (ARMS="... grpo-keep": only if the 4-hour cap allows)
# 4 paired seeds, one run at a time on an otherwise idle machine, the arms' order rotated seed by seed, so a slow
# spell of the machine does not fall on one arm. Each run's config and metrics are copied to reproduce/uniform-groups/RUN/
# as soon as it has trained; after the last run, every checkpoint is evaluated on the first 128 held-out problems
# (one sample each at the run's temperature; evaluation is not timed, so it may share the machine), and
# reproduce/report.py draws the comparison against pods-keep.
#
#   bash reproduce/uniform_groups.sh                     # ~2 h 10 min of training, then ~15 min of evaluation
#   STAGES=report bash reproduce/uniform_groups.sh      # only redraw reproduce/uniform-groups/*.txt and *.png
#
# Resumable: Ctrl-C, then the same command: a trained run is not redone, an interrupted one continues from its last
# checkpoint (one that died before its first starts over), an evaluated checkpoint is skipped.
{  # read whole before it runs: editing this file during the run cannot change it
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS-"0 1 2 3"}; BUDGET=${BUDGET:-10}; OUT=${OUT:-runs/uniform-groups}; KEEP=reproduce/uniform-groups
ARMS=${ARMS-"pods-keep pods-refill grpo-refill"}
STAGES=${STAGES:-"train eval report"}
TASK=arith:2
TRAIN="--dataset $TASK --prompts-per-step 4 --max-new-tokens 32 --lr 3e-4 --warmup-ratio 0 --bf16-autocast --merged-sampler"
TRAIN="$TRAIN --steps 1000 --time-budget $BUDGET --save-every-minutes 2 --save-every-steps 0"
EVAL="--dataset $TASK --limit 128 --repeats 1"

flags() {  # an arm's train.py flags
  case $1 in
    pods-keep) echo "--rule max_variance --n 8 --m 4";;
    pods-refill) echo "--rule max_variance --n 8 --m 4 --uniform-groups refill";;
    grpo-refill) echo "--rule none --n 8 --uniform-groups refill";;
    grpo-keep) echo "--rule none --n 8";;
    *) echo "unknown arm '$1' in ARMS: pass some of pods-keep pods-refill grpo-refill grpo-keep" >&2; return 1;;
  esac
}
for arm in $ARMS; do flags "$arm" > /dev/null; done

if [[ " $STAGES " == *" train "* || " $STAGES " == *" eval "* ]] \
   && ! python -c "import sys, model; sys.exit(0 if model.computes_bfloat16('cpu') else 1)"; then
  echo "this CPU has no bfloat16 arithmetic (no AVX-512 BF16 or AMX): these runs compute in bfloat16, which it would emulate ~12x slower"
  exit 1
fi

finished() {  # run dir $1 trained its whole budget
  [ -f "$1/metrics.jsonl" ] && python -c "
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if rows and rows[-1]['elapsed_s'] >= float(sys.argv[2]) * 60 else 1)" "$1/metrics.jsonl" "$BUDGET"
}

train() {  # seed $1, arm $2
  local name=$2-s$1 dir=$OUT/$2-s$1 resume=()
  if finished "$dir" || { [ ! -d "$dir" ] && finished "$KEEP/$name"; }; then return; fi
  if ls "$dir" 2>/dev/null | grep -q checkpoint-; then resume=(--resume); else rm -rf "$dir"; fi
  mkdir -p "$OUT" "$KEEP/$name"
  echo "$(date -u +%H:%M:%S) training $name (log: $dir.log)"
  # shellcheck disable=SC2046
  python train.py $TRAIN --seed "$1" $(flags "$2") "${resume[@]}" --out-dir "$dir" >> "$dir.log" 2>&1 \
    || { echo "train.py failed for $name: see the end of $dir.log"; exit 1; }
  cp "$dir"/{config.json,metrics.jsonl} "$KEEP/$name/"  # at once: runs/ is not in git
}

if [[ " $STAGES " == *" train "* ]]; then
  for seed in $SEEDS; do
    arms=($ARMS); shift_by=$((seed % ${#arms[@]}))
    for arm in "${arms[@]:shift_by}" "${arms[@]:0:shift_by}"; do train "$seed" "$arm"; done  # rotated seed by seed
  done
fi

if [[ " $STAGES " == *" eval "* ]]; then
  for seed in $SEEDS; do for arm in $ARMS; do
    name=$arm-s$seed
    if [ -f "$KEEP/$name/eval-arith-2.json" ] && [ ! -d "$OUT/$name" ]; then continue; fi  # evaluated on another machine
    if ! finished "$OUT/$name"; then echo "not evaluated: $name has not finished training"; continue; fi
    python eval.py "$OUT/$name" $EVAL
    cp "$OUT/$name/eval-arith-2.json" "$KEEP/$name/"
  done; done
fi

if [[ " $STAGES " == *" report "* ]]; then
  shopt -s nullglob
  evaluated() { local dir; for dir in "$@"; do [ ! -f "$dir/eval-arith-2.json" ] || echo "$dir"; done; }
  for arm in $ARMS; do
    [ "$arm" != pods-keep ] || continue
    python reproduce/report.py $(evaluated "$KEEP"/pods-keep-s* "$KEEP/$arm"-s*) --dataset $TASK \
      --baseline "PODS max_variance n=8 m=4" --out "$KEEP/$arm.png" > "$KEEP/$arm.txt" \
      || { rm -f "$KEEP/$arm.txt"; echo "not drawn yet: $KEEP/$arm (see the line above)"; }
  done
fi
exit
}
