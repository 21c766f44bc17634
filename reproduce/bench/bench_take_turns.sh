#!/usr/bin/env bash
# What taking turns (reproduce/take_turns.py) costs a run's own steps: grpo-n8-s0's first 6 steps of the
# plateau plan alone, then in a group of four taking turns with the seed's other settings (as
# TAKE_TURNS=1 runs a seed), back to back, REPEATS times. Each line: the median generation + update
# seconds of steps 2-6 (what report.py's step-cost table reads) alone and in turns, and their ratio.
# Run it on an idle machine (~6 minutes a repeat on 2 cores), in the project root:
#     bash reproduce/bench/bench_take_turns.sh            # REPEATS=2 for two pairs
set -euo pipefail
cd "$(dirname "$0")/../.."
REPEATS=${REPEATS:-1}; R=${OUT:-/tmp/bench_take_turns}
COMMON="--dataset arith:2 --prompts-per-step 4 --max-new-tokens 32 --lr 3e-4 --steps 6 --time-budget 15
        --save-every-minutes 0 --save-every-steps 0 --warmup-ratio 0 --seed 0"
rm -rf "$R"; mkdir -p "$R"
for rep in $(seq "$REPEATS"); do
  python train.py $COMMON --rule none --n 8 --out-dir "$R/alone-$rep" > /dev/null
  T=$R/turns-$rep; pids=()
  for setting in "none --n 8" "max_variance --n 8 --m 4" "none --n 4" "max_variance --n 16 --m 4"; do
    python reproduce/take_turns.py "$T" train.py $COMMON --rule $setting --out-dir "$R/$rep-${setting// /}" > /dev/null &
    pids+=($!); sleep 1  # in the plan's order: grpo-n8 first
  done
  touch "$T/start"; wait "${pids[@]}"
  python - "$R/alone-$rep" "$R/$rep-none--n8" <<'PY'
import statistics, sys, time
from pathlib import Path
sys.path.insert(0, "reproduce")
import plot, stats
alone, turns = (plot.read_metrics(Path(run)) for run in sys.argv[1:])
part = lambda rows, key: statistics.median(r[key] for r in rows[1:6])  # noqa: E731
line = lambda rows: f"{stats.early_step_seconds(rows):.2f} s (generation {part(rows, 'generation_s'):.2f}, update {part(rows, 'update_s'):.2f})"  # noqa: E731
print(f"{time.strftime('%Y-%m-%d %H:%M')} grpo-n8-s0 steps 2-6: alone {line(alone)}, taking turns {line(turns)}: "
      f"{stats.early_step_seconds(turns) / stats.early_step_seconds(alone):.2f}x")
PY
done
