#!/usr/bin/env bash
# CPU-scale reproduction of the paper's comparison (README, "Measured on a CPU").
# Embedded SmolLM2-135M-Instruct on one-digit sums (arith:1, where it starts near 20%), every run under the
# same wall-clock training budget, one run at a time; then every checkpoint evaluated on the held-out split;
# then two figures with their time-to-baseline-peak tables.
#   bash docs/cpu_reproduction.sh       # BUDGET=4 minutes of training per run, 8 runs
# Re-running it skips finished runs and already evaluated checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-4}
OUT=${OUT:-runs/cpu}
LR=${LR:-3e-4}
COMMON="--dataset arith:1 --prompts-per-step 4 --max-new-tokens 32 --lr $LR --steps 1000 --time-budget $BUDGET
        --save-every-minutes 0.5 --save-every-steps 0 --warmup-ratio 0"
EVAL="--dataset arith:1 --limit 64 --repeats 2"

run() {
  local dir=$1; shift
  if [ -f "$dir/metrics.jsonl" ] && ls "$dir" | grep -q checkpoint-; then
    python train.py $COMMON "$@" --out-dir "$dir" --resume  # a finished run stops at once (budget reached)
  else
    python train.py $COMMON "$@" --out-dir "$dir"
  fi
}

start=$(date +%s)
for seed in 0 1; do
  run "$OUT/grpo-n4-s$seed" --seed $seed --rule none --n 4                    # GRPO on m = 4
  run "$OUT/pods-n8-m4-s$seed" --seed $seed --rule max_variance --n 8 --m 4   # PODS: generate 8, keep 4
  run "$OUT/grpo-n8-s$seed" --seed $seed --rule none --n 8                    # GRPO on all n = 8
done
run "$OUT/maxreward-n8-m4-s0" --seed 0 --rule max_reward --n 8 --m 4          # ablation: other rules
run "$OUT/random-n8-m4-s0" --seed 0 --rule random --n 8 --m 4
trained=$(date +%s)

for dir in "$OUT"/*/; do python eval.py "$dir" $EVAL; done
evaluated=$(date +%s)

# The paper's setting: GRPO on m rollouts against PODS generating n = 2m and keeping m (+ the ablation).
python eval.py --plot "$OUT"/grpo-n4-s* "$OUT"/pods-n8-m4-s* "$OUT"/maxreward-n8-m4-s0 "$OUT"/random-n8-m4-s0 \
  --dataset arith:1 --out docs/cpu_grpo_m_vs_pods.png | tee docs/cpu_grpo_m_vs_pods.txt
# Equal n, the comparison a CPU favours: GRPO on all n against PODS keeping n/2 of the same n.
python eval.py --plot "$OUT"/grpo-n8-s* "$OUT"/pods-n8-m4-s* --dataset arith:1 --out docs/cpu_equal_n.png \
  | tee docs/cpu_equal_n.txt
echo "wall clock: training $(( (trained - start) / 60 )) min, evaluation $(( (evaluated - trained) / 60 )) min" \
  | tee -a docs/cpu_equal_n.txt
