#!/usr/bin/env bash
# Exploratory: groups with nothing to learn from (train.py --uniform-groups), composed with PODS, on a CPU
# (reproduce/uniform-groups/README.md). The reproduction's task and settings (arith:2, 4 prompts a step, 32 new
# tokens, LR 3e-4 constant, bfloat16 autocast), 10 minutes of training a run, a checkpoint every 2 minutes:
#   pods-keep     PODS max-variance n=8 m=4, uniform groups kept (the paper)
#   pods-refill   the same, uniform groups left out and the step refilled (DAPO's dynamic sampling)
#   grpo-refill   GRPO n=8, refilled (DAPO's dynamic sampling alone)
#   grpo-keep     GRPO n=8 (not run: ARMS="pods-keep pods-refill grpo-refill grpo-keep" adds it, ~45 min more with evaluation)
# 4 paired seeds, one run at a time on an otherwise idle machine, the arms' order rotated seed by seed, so a slow
# spell of the machine does not fall on one arm. Each run's config and metrics are copied to reproduce/uniform-groups/RUN/
# as soon as it has trained; after the last run, every checkpoint is evaluated on the first 128 held-out problems
# (one sample each at the run's temperature; evaluation is not timed, so it may share the machine), and
# reproduce/report.py draws every arm against pods-keep (report.txt, report.png); steps.txt says what each arm's
# steps did (uniform share, generation rounds, prompts drawn, informative rows), from the kept metrics.
#
#   bash reproduce/uniform_groups.sh                     # ~2 h 10 min of training, then ~15 min of evaluation
#   STAGES=report bash reproduce/uniform_groups.sh      # only redraw reproduce/uniform-groups/report.* and steps.txt
#
# Resumable: Ctrl-C, then the same command: a trained run is not redone, an interrupted one continues from its last
# checkpoint (one that died before its first starts over), an evaluated checkpoint is skipped.
{  # read whole before it runs: editing this file during the run cannot change it
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS-"0 1 2 3"}; BUDGET=${BUDGET:-10}; OUT=${OUT:-runs/uniform-groups}; KEEP=reproduce/uniform-groups
ARMS=${ARMS:-"pods-keep pods-refill grpo-refill"}
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

keep_record() {  # run $1's config and metrics into reproduce/ (runs/ is not in git)
  mkdir -p "$KEEP/$1"; cp "$OUT/$1"/{config.json,metrics.jsonl} "$KEEP/$1/"
}

train() {  # seed $1, arm $2
  local name=$2-s$1 dir=$OUT/$2-s$1 resume=""
  if finished "$dir"; then keep_record "$name"; return; fi  # (again: a stop just after its training may have missed it)
  if [ ! -d "$dir" ] && finished "$KEEP/$name"; then return; fi  # trained on another machine
  if compgen -G "$dir/checkpoint-*" > /dev/null; then resume=--resume; else rm -rf "$dir"; fi
  mkdir -p "$OUT"
  echo "$(date -u +%H:%M:%S) training $name (log: $dir.log)"
  # shellcheck disable=SC2046
  python train.py $TRAIN --seed "$1" $(flags "$2") $resume --out-dir "$dir" >> "$dir.log" 2>&1 \
    || { echo "train.py failed for $name: see the end of $dir.log"; exit 1; }
  keep_record "$name"  # at once, before the next run
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
    if ! finished "$OUT/$name"; then
      if finished "$KEEP/$name"; then echo "not evaluated: $name trained on another machine, its checkpoints are not here"
      else echo "not evaluated: $name has not finished training"; fi
      continue
    fi
    python eval.py "$OUT/$name" $EVAL
    keep_record "$name"; cp "$OUT/$name/eval-arith-2.json" "$KEEP/$name/"
  done; done
fi

if [[ " $STAGES " == *" report "* ]]; then  # every arm against pods-keep, the seeds where all have been evaluated
  runs=()
  for seed in $SEEDS; do
    whole=1; for arm in $ARMS; do [ -f "$KEEP/$arm-s$seed/eval-arith-2.json" ] || whole=0; done
    if [ $whole = 1 ]; then for arm in $ARMS; do runs+=("$KEEP/$arm-s$seed"); done; fi
  done
  python reproduce/report.py ${runs[@]+"${runs[@]}"} --dataset $TASK --baseline "PODS max_variance n=8 m=4" \
    --out "$KEEP/report.png" > "$KEEP/report.txt.new" && mv "$KEEP/report.txt.new" "$KEEP/report.txt" && cat "$KEEP/report.txt" \
    || { rm -f "$KEEP/report.txt.new"; echo "not drawn yet: $KEEP/report (see the line above)"; }
  # what each arm's steps did, from the kept metrics alone (every trained run, evaluated or not)
  python - "$KEEP" $ARMS <<'EOF' > "$KEEP/steps.txt.new" && mv "$KEEP/steps.txt.new" "$KEEP/steps.txt" && cat "$KEEP/steps.txt"
import json, sys
from pathlib import Path
import numpy as np
keep, arms = Path(sys.argv[1]), sys.argv[2:]
print("each arm's steps, mean over its trained seeds: steps in the budget; the share of uniform groups in a step's first "
      "round; generation rounds and prompts drawn a step; informative rows a step (keep updates on all its kept rows); "
      "steps with no update (no informative group); seconds a step")
print(f"{'arm':<14}{'seeds':>6}{'steps':>8}{'uniform':>9}{'rounds':>8}{'prompts':>9}{'informative':>13}{'no update':>11}{'step s':>8}")
for arm in arms:
    runs = [[json.loads(line) for line in open(p)] for p in sorted(keep.glob(f"{arm}-s*/metrics.jsonl"))]
    if not runs:
        continue
    mean = lambda key: np.mean([np.mean([r[key] for r in rows]) for rows in runs])  # noqa: E731
    idle = np.mean([sum(r["informative_rows"] == 0 for r in rows) for rows in runs]) if arm.endswith("refill") else 0.0
    step_s = np.mean([rows[-1]["elapsed_s"] / len(rows) for rows in runs])
    print(f"{arm:<14}{len(runs):>6}{np.mean([len(rows) for rows in runs]):>8.1f}{mean('uniform_share'):>9.2f}{mean('generation_rounds'):>8.2f}"
          f"{mean('prompts_drawn'):>9.2f}{mean('informative_rows'):>13.1f}{idle:>11.1f}{step_s:>8.2f}")
EOF
fi
exit
}
