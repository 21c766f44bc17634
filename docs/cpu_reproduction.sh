#!/usr/bin/env bash
# CPU-scale reproduction of the paper's comparison (README, "Measured on a CPU").
# Embedded SmolLM2-135M-Instruct on one-digit sums (arith:1, where it starts at ~20%), every run under the same
# wall-clock budget, then every checkpoint evaluated on the held-out split, then two figures.
#   bash docs/cpu_reproduction.sh            # BUDGET=4 minutes per run, 7 runs, ~50 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-4}
OUT=${OUT:-runs/cpu}
COMMON="--dataset arith:1 --prompts-per-step 4 --max-new-tokens 32 --steps 1000 --time-budget $BUDGET --save-every-minutes 1 --save-every-steps 0"
EVAL="--dataset arith:1 --limit 50 --repeats 2"

run() {  # skip runs that already finished, so the script can be re-run after an interruption
  local dir=$1; shift
  if [ -f "$dir/metrics.jsonl" ] && ls "$dir" | grep -q checkpoint-; then
    python train.py $COMMON "$@" --out-dir "$dir" --resume
  else
    python train.py $COMMON "$@" --out-dir "$dir"
  fi
}

for seed in 0 1; do
  run "$OUT/grpo-n8-s$seed" --seed $seed --rule none --n 8
  run "$OUT/pods-n16-m8-s$seed" --seed $seed --rule max_variance --n 16 --m 8
done
run "$OUT/grpo-n16-s0" --seed 0 --rule none --n 16
run "$OUT/maxreward-n16-m8-s0" --seed 0 --rule max_reward --n 16 --m 8
run "$OUT/random-n16-m8-s0" --seed 0 --rule random --n 16 --m 8

for dir in "$OUT"/*/; do python eval.py "$dir" $EVAL; done

# The paper's setting: GRPO on m rollouts against PODS generating n = 2m and keeping m (+ ablations).
python eval.py --plot "$OUT"/grpo-n8-s* "$OUT"/pods-n16-m8-s* "$OUT"/maxreward-n16-m8-s0 "$OUT"/random-n16-m8-s0 \
  --dataset arith:1 --out docs/cpu_grpo_m_vs_pods.png | tee docs/cpu_grpo_m_vs_pods.txt
# Equal n, the comparison a CPU favours: GRPO on all n against PODS keeping n/2.
python eval.py --plot "$OUT"/grpo-n16-s* "$OUT"/pods-n16-m8-s* --dataset arith:1 --out docs/cpu_equal_n.png | tee docs/cpu_equal_n.txt
