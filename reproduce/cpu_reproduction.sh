#!/usr/bin/env bash
# CPU-scale reproduction of the paper's comparisons (reproduce/README.md).
#
# The embedded SmolLM2-135M-Instruct on arith:2 (one-digit sums and differences in a one-sentence
# story; it starts at ~0.11 test accuracy and GRPO does not saturate within the budget), every run
# with the same budget of training minutes, one run at a time, methods interleaved within each seed:
#   1. equal rollouts generated: GRPO on all n=8, PODS max-variance n=8 m=4 and m=2   (seeds 0, 1, 2)
#   2. rules at n=8 m=2: max-variance (from 1), max-reward, random                    (seeds 0, 1)
#   3. n at m=4: GRPO n=4, PODS n=8 m=4 (from 1), PODS n=16 m=4                        (seeds 0, 1)
# As soon as a run finishes training, its config and metrics are copied to reproduce/cpu/RUN/ (kept in the
# repository, a few KB each) and every checkpoint of it (one a minute) is evaluated on 256 held-out problems
# (binomial standard error <= 0.031), the evaluation copied beside them, before the next run trains: a
# machine lost mid-plan takes the checkpoints of at most the run it was training or evaluating (TAKE_TURNS=1:
# the group; its runs are evaluated after it). The figures and tables are drawn from those copies.
#
#   bash reproduce/cpu_reproduction.sh                  # everything; BUDGET=3 minutes of training per run
#   STAGES=report bash reproduce/cpu_reproduction.sh    # only redraw figures and tables from reproduce/cpu/
#
# PLAN=plateau: the comparisons run to GRPO's plateau (BUDGET=15 minutes a run, from the probe in
# reproduce/README.md), with SEEDS="0 1 2 3 4 5 6 7 8 9" paired seeds (4-7 ran on a slower
# machine and are left out of the tables: 8 and 9 are for two of them), into runs/cpu-plateau and reproduce/cpu-plateau/:
# ~14 hours on 2 cores (44 runs of 15 minutes, each after a 1-minute speed check and then ~4.5 minutes of
# evaluation on an idle machine), meant to run in parts (Ctrl-C, then the same command continues, in a fresh checkout too):
#   1. equal rollouts generated (the paper's multi-GPU setting): GRPO n=8 against PODS n=8 m=4
#   2. equal rollouts updated (its single-GPU setting): GRPO n=4 against PODS n=16 m=4
#   3. n at m=4 (from 1 and 2): GRPO n=4, PODS n=8 m=4, PODS n=16 m=4     (6 seeds)
#   4. rules at n=8 m=4: max-variance (from 1), max-reward, random            (ABLATION_SEEDS="0 1")
#   PLAN=plateau bash reproduce/cpu_reproduction.sh
# or a seed at a time, each trained, evaluated and reported before the next (a part-way report at any stop):
#   for s in 0 1 2 3 4 5 6 7 8 9; do PLAN=plateau SEEDS=$s ABLATION_SEEDS= bash reproduce/cpu_reproduction.sh; done
#   PLAN=plateau SEEDS= bash reproduce/cpu_reproduction.sh          # then the ablations
#
# Runs whose steps were slower than their setting's other seeds (report.py's step-cost table marks them
# "slower machine") did not run on the idle machine the comparison needs: list their seed in
# reproduce/cpu-plateau/slower-machine-seeds.txt, run a further seed (SEEDS=9), and the tables leave it out.
# The report also draws every evaluated seed on the reference clock (reproduce/cpu_plateau_*_reference_clock:
# each step timed as the unlisted seeds' machine took such a step, report.py --reference-runs), and the
# unlisted seeds alone on it (*_clock_check) beside their own clocks, and the seeds that trained the whole
# budget on it (*_clock_to_budget: the unlisted seeds and those trained with CLOCK=reference). Those to-budget seeds
# are each comparison's primary reading: reproduce/headline.py draws reproduce/cpu_paired_differences.png (the README's
# headline figure) and prints reproduce/cpu_primary.txt from them.
#
# CLOCK=reference (any machine, busy or not): each run trains to BUDGET minutes on the reference clock instead
# of its own, in chunks (train.py --steps N, then --resume with a larger N; the LR is constant), each chunk's N
# from reference_clock.ReferenceClock over the unlisted seeds' runs, ending less than a step past the budget, with a
# checkpoint every ~reference minute of steps; no speed check (the clock does not read this machine's time),
# and the run's seed is listed in slower-machine-seeds.txt, so the wall-clock tables leave it out and the
# *_clock_to_budget tables take it. Ctrl-C, then the same command continues. For new seeds:
#   PLAN=plateau CLOCK=reference SEEDS=9 ABLATION_SEEDS= bash reproduce/cpu_reproduction.sh
# and the rules ablation for seeds trained so (max-reward and random timed with max-variance's line at the same
# n and m; drawn against max-variance at the same seeds in reproduce/cpu_plateau_rules_clock_to_budget, and on the
# seeds where all three rules ran in reproduce/cpu_plateau_rules_clock_paired):
#   PLAN=plateau CLOCK=reference SEEDS= ABLATION_SEEDS="9 10" bash reproduce/cpu_reproduction.sh
# A larger BUDGET continues runs trained on the clock from their last checkpoint; COMPARISONS=updates (or rollouts)
# takes one comparison's runs only. GRPO n=4 was still rising at 15 minutes, so equal updates runs to 20:
#   PLAN=plateau CLOCK=reference BUDGET=20 COMPARISONS=updates SEEDS="9 10" ABLATION_SEEDS= bash reproduce/cpu_reproduction.sh
#
# Before each training run the script repeats the first 6 steps of seed REF_SEED (default 0) of the run's setting (the same
# n and m; ~1 minute) and stops (exit 1) if they take more than 1.25x as long as in its record: the
# machine is busy or slower, its speed drifts within an hour, and a slower machine does not slow every
# setting alike (PODS n=8 m=4 most), so every run is checked with its own work (CHECK_SPEED=0 skips it).
# Training and evaluation stop at once (exit 1) on a CPU without bfloat16 arithmetic (no AVX-512 BF16 or AMX; CHECK_CPU=0
# skips it): the kept runs computed in bfloat16, which such a CPU emulates, a step ~12x slower.
# PRECISION=float32 (such a CPU, with CLOCK=reference): new seeds train and evaluate in float32, each seed's runs
# in one precision (a run begun in the other is refused), and the tables name each seed's precision:
#   PLAN=plateau CLOCK=reference BUDGET=20 COMPARISONS=updates SEEDS=15 ABLATION_SEEDS= PRECISION=float32 bash reproduce/cpu_reproduction.sh
# It also stops if those steps' metrics differ from the record's: the same seed and settings give the same
# numbers on one machine, and other numbers on another (seeds 0-3's machine is not the one later sessions
# had; reproduce/README.md). REF_SEED=S makes seed S's records the reference: a series on another machine.
#
# TAKE_TURNS=1 (for a machine whose speed drifts): a seed's runs start together and take turns a training
# step at a time, the run with the fewest seconds trained next (reproduce/take_turns.py), so their training
# clocks stay within a step and a slow spell falls on the same minutes of every run; the machine is
# checked once, before the group starts, each run logs to $OUT/NAME.log, and
# Ctrl-C (or kill) makes each save a checkpoint in its turn. A run that took turns keeps its turns.jsonl.
# Not for the kept runs: on 2 cores a run's steps 2-6 took 1.11-1.19x as long in a group taking turns as
# alone (reproduce/bench/bench_take_turns.sh, 24 November 2026), updates more than generation, so the group's
# methods are not timed as seeds 0-3's were; from seed 6 on, runs go one at a time, like seeds 0-3.
#
# Resumable: a finished run (its budget reached) is not redone, an interrupted one continues from its
# last checkpoint, and evaluated checkpoints are skipped.
{  # read whole before it runs: editing or pulling this file during an hours-long run cannot change it
set -euo pipefail
cd "$(dirname "$0")/.."
PLAN=${PLAN:-first}
if [ "$PLAN" = plateau ]; then
  BUDGET=${BUDGET:-15}; OUT=${OUT:-runs/cpu-plateau}; KEEP=reproduce/cpu-plateau; SEEDS=${SEEDS-"0 1 2 3 4 5 6 7 8 9"}  # 4-7 slower (slower-machine-seeds.txt)
  ABLATION_SEEDS=${ABLATION_SEEDS-"0 1"}  # ABLATION_SEEDS= (empty): none
  COMPARISONS=${COMPARISONS-"rollouts updates"}  # COMPARISONS=updates: only equal updates' runs (e.g. a longer BUDGET for GRPO n=4)
  for comparison in $COMPARISONS; do
    case $comparison in rollouts|updates) ;; *) echo "COMPARISONS=$COMPARISONS: pass rollouts, updates or both (e.g. COMPARISONS=updates)"; exit 1;; esac
  done
else
  BUDGET=${BUDGET:-3}; OUT=${OUT:-runs/cpu}; KEEP=reproduce/cpu
fi
STAGES=${STAGES:-"train eval report"}
TAKE_TURNS=${TAKE_TURNS:-0}
CLOCK=${CLOCK:-wall}
TASK=arith:2
PRECISION=${PRECISION:-bfloat16}  # of training and evaluation: float32 for a series on a CPU without bfloat16 arithmetic (check_cpu)
case $PRECISION in
  bfloat16) AUTOCAST=--bf16-autocast;;
  float32) AUTOCAST=;;  # train.py's and eval.py's default on such a CPU
  *) echo "PRECISION=$PRECISION: pass bfloat16 (the kept runs') or float32 (a CPU without bfloat16 arithmetic)"; exit 1;;
esac
TRAIN="--dataset $TASK --prompts-per-step 4 --max-new-tokens 32 --lr 3e-4 --warmup-ratio 0 $AUTOCAST --merged-sampler"  # every run's (a constant LR)
COMMON="$TRAIN --steps 1000 --time-budget $BUDGET --save-every-minutes 1 --save-every-steps 0"  # to BUDGET minutes of its own
if [ "$CLOCK" = reference ]; then  # to BUDGET minutes on the reference clock: train_by_clock
  if [ "$PLAN" != plateau ] || [ "$TAKE_TURNS" = 1 ]; then echo "CLOCK=reference is for PLAN=plateau, one run at a time (not TAKE_TURNS=1)"; exit 1; fi
elif [ "$TAKE_TURNS" = 1 ] && [ "$PLAN" != plateau ]; then
  echo "TAKE_TURNS=1 is for PLAN=plateau (the first plan's runs go one at a time)"; exit 1
elif [ "$CLOCK" != wall ]; then
  echo "CLOCK=$CLOCK: pass CLOCK=wall (each run's own minutes, on seeds 0-3's idle machine) or CLOCK=reference"; exit 1
fi
EVAL="--dataset $TASK --limit 256 --repeats 1"

check_cpu() {  # the kept runs computed in bfloat16 on CPUs with AVX-512 BF16; elsewhere torch emulates it
  if [ "${CHECK_CPU:-1}" = 0 ] || [[ " $STAGES " != *" train "* && " $STAGES " != *" eval "* ]]; then return; fi
  if python -c "import sys, model; sys.exit(0 if model.computes_bfloat16('cpu') else 1)"; then
    if [ "$PRECISION" = float32 ]; then
      echo "PRECISION=float32 is for a CPU without bfloat16 arithmetic: eval.py evaluates in bfloat16 on this one, not in the" \
           "precision its runs trained in; leave PRECISION out (bfloat16, as the kept runs)"
      exit 1
    fi
  elif [ "$PRECISION" = bfloat16 ]; then
    echo "this CPU has no bfloat16 arithmetic (no AVX-512 BF16 or AMX): the kept runs train and evaluate in bfloat16, which it emulates" \
         "(a GRPO n=8 step ~12x slower than in float32; docs/speed.md), and eval.py would evaluate in float32 here, which" \
         "the tables refuse to mix; use a CPU with AVX-512 BF16 (lscpu: avx512_bf16), or PRECISION=float32 for new seeds" \
         "trained and evaluated in float32 (CLOCK=reference), or CHECK_CPU=0 to run anyway (STAGES=report needs neither)"
    exit 1
  fi
}
check_cpu

# Seeds whose runs did not run on the reference machine (seeds 0-3's), a seed a line with why: the wall-clock tables leave them out
listed_seeds() { echo " $(grep -v '^#' "$KEEP/slower-machine-seeds.txt" 2>/dev/null | awk '{print $1}' | tr '\n' ' ')"; }
idle() { local dir listed; listed=$(listed_seeds); for dir in "$@"; do [[ "$listed" == *" ${dir##*-s} "* ]] || echo "$dir"; done; }
reference_runs() { idle "$KEEP"/grpo-n8-s* "$KEEP"/pods-n8-m4-s* "$KEEP"/grpo-n4-s* "$KEEP"/pods-n16-m4-s*; }

clock() {  # CLOCK=reference: "STEPS_LEFT SAVE_EVERY" for run dir $1 (then its train.py arguments, for a run not started):
  # the steps it needs to reach BUDGET minutes on the reference clock (0: reached; reference_clock.ReferenceClock over the unlisted
  # seeds' runs), and a checkpoint interval of about a reference minute, in steps
  python - "$BUDGET" "$@" :: $(reference_runs) <<'EOF'
import argparse, sys
from pathlib import Path
sys.path.insert(0, "reproduce")
import eval, plot
from reference_clock import ReferenceClock
budget, run, *rest = sys.argv[1:]
args, reference = rest[:rest.index("::")], [Path(r) for r in rest[rest.index("::") + 1:]]
parser = argparse.ArgumentParser()  # a run not started: its setting from its train.py arguments
for flag, kind in (("--rule", str), ("--n", int), ("--m", int)):
    parser.add_argument(flag, type=kind)
config = eval.run_config(run) or vars(parser.parse_known_args(args)[0])
label, clock = plot.label_of(config), ReferenceClock(reference)
print(clock.steps_left(label, plot.read_metrics(Path(run)), float(budget) * 60), max(1, round(60 / clock.mean_step[clock.setting(label)])))
EOF
}

own_precision() {  # run $1 (its dir here, else its record in reproduce/) did not train in the other precision: a run trains
  # and evaluates in one
  local dir=$OUT/$1 other=true; [ -d "$dir" ] || dir=$KEEP/$1; [ "$PRECISION" = float32 ] || other=false
  if grep -qE "\"bf16_autocast\": *$other" "$dir/config.json" 2>/dev/null; then
    echo "$1 in $(dirname "$dir") did not train in $PRECISION (its config.json: bf16_autocast $other): pass the" \
         "PRECISION it trained in, or SEEDS and ABLATION_SEEDS without its seed"
    exit 1
  fi
}

by_clock() { grep -qE '"time_budget": *0(\.0)?([,}]|$)' "$1/config.json" 2>/dev/null; }  # run $1 trained to a number of steps (CLOCK=reference)

finished() {  # the run has trained its whole budget: its own minutes, or (a run trained with CLOCK=reference) the clock's
  [ -f "$1/metrics.jsonl" ] || return 1
  if by_clock "$1"; then
    [ "$(clock "$1" | cut -d' ' -f1)" = 0 ]; return
  fi
  python - "$1/metrics.jsonl" "$BUDGET" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if rows and rows[-1]["elapsed_s"] >= float(sys.argv[2]) * 60 else 1)
EOF
}

check_speed() {  # PLAN=plateau, before training run $1: is this the kept runs' machine, for its setting?
  local ref args s=${REF_SEED:-0}  # the plan's run of seed REF_SEED doing the same work a step (a rules ablation's: max-variance's)
  case $1 in
    grpo-n8-*) ref=grpo-n8-s$s args="--rule none --n 8";;
    grpo-n4-*) ref=grpo-n4-s$s args="--rule none --n 4";;
    pods-n16-m4-*) ref=pods-n16-m4-s$s args="--rule max_variance --n 16 --m 4";;
    *) ref=pods-n8-m4-s$s args="--rule max_variance --n 8 --m 4";;
  esac
  if [ "$PLAN" != plateau ] || [ "${CHECK_SPEED:-1}" = 0 ] || [ ! -f "$KEEP/$ref/metrics.jsonl" ]; then
    return
  fi
  # Its first 6 steps again (the same seed and settings, so the same work), against its record.
  rm -rf "$OUT/speed-check"
  python train.py $COMMON --seed $s $args --steps 6 --save-every-minutes 0 --out-dir "$OUT/speed-check" > /dev/null 2>&1 \
    || { echo "speed check: train.py failed; see: python train.py $COMMON --seed $s $args --steps 6 --out-dir $OUT/speed-check"; exit 1; }
  python - "$OUT/speed-check" "$KEEP/$ref" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "reproduce")
import plot, stats
from replay_run import differences
here, record = (plot.read_metrics(Path(run)) for run in sys.argv[1:])
wrong = [f"step {a['step']}: {d[0]}" for a, b in zip(here, record) for d in [differences(a, b)] if d]
if wrong:  # the same seed and settings give other numbers: other hardware, not only another speed
    print(f"speed check: this machine computes differently from the one {Path(sys.argv[2]).name} trained on ({wrong[0]}), "
          "so its runs are another machine's: run the plan where its records were made, or start a series of this "
          "machine's own (REF_SEED=a seed trained here), or CHECK_SPEED=0 to train anyway")
    sys.exit(1)
now, kept = (stats.early_step_seconds(rows) for rows in (here, record))
print(f"speed check: {Path(sys.argv[2]).name}'s steps 2-6 take {now:.1f} s a step here, {kept:.1f} s in its record ({now / kept:.2f}x)")
if now / kept > stats.SLOW_MACHINE:
    print("this machine is slower than the one the kept runs were timed on, so its minutes would not be theirs: "
          "run again when it is idle, or CHECK_SPEED=0 to train anyway (then read the step-cost tables' x median)")
    sys.exit(1)
EOF
}

list_seed() {  # CLOCK=reference, before training run $1 (seed $2): its seed is listed, so the wall-clock tables leave it out
  local seed=$2 dir
  if [[ "$(listed_seeds)" == *" $seed "* ]]; then return; fi
  for dir in "$KEEP"/*-s"$seed"; do
    if [ -f "$dir/config.json" ] && ! by_clock "$dir"; then
      echo "CLOCK=reference: seed $seed's runs in $KEEP ($(basename "$dir"), ...) are the reference clock's own runs, timed by" \
           "their own minutes; train $1 with CLOCK=wall on their machine, or pass SEEDS and ABLATION_SEEDS without seed $seed"
      exit 1
    fi
  done
  local precision=""; [ "$PRECISION" = bfloat16 ] || precision=", in $PRECISION"
  echo "$seed       trained on the reference clock (CLOCK=reference$precision, from $(date -u '+%d %B %Y %H:%M') UTC): timed by the reference machine's step costs, not its own minutes" >> "$KEEP/slower-machine-seeds.txt"
}

train_by_clock() {  # CLOCK=reference: train.py in chunks of --steps, each resuming the last, until the reference clock reaches BUDGET
  local dir=$1 plan left every; shift
  list_seed "$(basename "$dir")" "$(sed -n 's/.*--seed \([0-9]*\).*/\1/p' <<< "$*")"
  while true; do
    plan=$(clock "$dir" "$@")  # (a failure stops the script: set -e)
    read -r left every <<< "$plan"
    if [ "$left" = 0 ]; then return; fi
    local resume=()
    if ls "$dir" 2>/dev/null | grep -q checkpoint-; then resume=(--resume); else rm -rf "$dir"; fi
    local done_steps=0
    if [ -f "$dir/metrics.jsonl" ]; then done_steps=$(grep -c . "$dir/metrics.jsonl"); fi
    echo "$(basename "$dir"): $left more steps to reach $BUDGET minutes on the reference clock (a checkpoint every $every)"
    python train.py $TRAIN "$@" --steps $((done_steps + left)) --save-every-minutes 0 --save-every-steps "$every" "${resume[@]}" --out-dir "$dir"
  done
}

run() {  # a run finished here, or kept in reproduce/ from another machine (runs/ is not in git), is not redone
  own_precision "$1"
  local dir=$OUT/$1 kept=$KEEP/$1; shift
  if finished "$dir"; then after_training "$dir"; return; fi  # (again: a stop just after its training may have missed it)
  if [ ! -d "$dir" ] && finished "$kept"; then return; fi
  if [ "$CLOCK" = reference ] || by_clock "$dir"; then train_by_clock "$dir" "$@"; after_training "$dir"; return; fi  # (begun on the clock: stays on it)
  if ls "$dir" 2>/dev/null | grep -q checkpoint-; then
    set -- "$@" --resume
  else
    rm -rf "$dir"  # a run that died before its first checkpoint starts over
  fi
  if [ "$TAKE_TURNS" = 1 ]; then  # started now, trained in turn with the seed's other runs (took_turns waits for them)
    if [ ${#TURN_PIDS[@]} -eq 0 ]; then check_speed "$(basename "$dir")"; mkdir -p "$OUT"; rm -rf "$OUT/turns"; fi  # a new group
    set -m  # in its own process group: a Ctrl-C reaches the runs once, from stop_turns, not also from the terminal
    python reproduce/take_turns.py "$OUT/turns" train.py $COMMON "$@" --out-dir "$dir" >> "$dir.log" 2>&1 &
    set +m
    TURN_PIDS+=($!) TURN_DIRS+=("$dir")
    echo "started $(basename "$dir") (taking turns; its log: $dir.log)"
    sleep 1  # the runs join the rotation in the plan's order
  else
    check_speed "$(basename "$dir")"
    python train.py $COMMON "$@" --out-dir "$dir"
    after_training "$dir"
  fi
}

keep_record() {  # a run whose training ended: its config and metrics into reproduce/ at once (runs/ is not in git), so a
  # machine lost before evaluation loses only the checkpoints, which reproduce/replay_run.py rebuilds from this record
  local dir=$1 kept=$KEEP/$(basename "$1") file
  mkdir -p "$kept"
  for file in config.json metrics.jsonl turns.jsonl; do if [ -f "$dir/$file" ]; then cp "$dir/$file" "$kept/"; fi; done
}

after_training() {  # run $1's training ended: its record kept at once, and (STAGES with eval) its checkpoints evaluated
  # now, not after the whole plan: a session's machine can go before then, and its checkpoints with it
  keep_record "$1"
  if [ ${#TURN_PIDS[@]} -gt 0 ]; then return; fi  # (runs taking turns are waiting to start: the final loop evaluates it)
  if [[ " $STAGES " == *" eval "* ]]; then evaluate "$(basename "$1")"; fi
}

TURN_PIDS=() TURN_DIRS=()
stop_turns() {  # Ctrl-C or kill: each run finishes its step, saves a checkpoint and exits (resumable)
  trap - INT TERM
  echo "stopping: each run saves a checkpoint in its turn"
  kill -TERM "${TURN_PIDS[@]}" 2>/dev/null || true
  wait
  exit 130
}
took_turns() {  # TAKE_TURNS=1: wait for the runs started together to end
  [ ${#TURN_PIDS[@]} -gt 0 ] || return 0
  trap stop_turns INT TERM
  mkdir -p "$OUT/turns"; touch "$OUT/turns/start"  # all have joined: the first run's turn begins
  local pid failed=0
  for pid in "${TURN_PIDS[@]}"; do wait "$pid" || failed=1; done
  trap - INT TERM
  TURN_PIDS=()
  if [ $failed = 1 ]; then echo "a run taking turns failed: see the end of its log in $OUT/*.log"; exit 1; fi
  local dir; for dir in "${TURN_DIRS[@]}"; do after_training "$dir"; done
  TURN_DIRS=()
}

EVALUATED=" " EVAL_S=0
evaluate() {  # a run still training (run in parts) waits for a later invocation
  if [[ "$EVALUATED" == *" $1 "* ]]; then return; fi  # (as soon as it trained, in this invocation)
  local began; began=$(date +%s)
  if [ ! -d "$OUT/$1" ] && [ -f "$KEEP/$1/eval-arith-2.json" ]; then return; fi  # evaluated on another machine
  own_precision "$1"
  if [ ! -d "$OUT/$1" ] && finished "$KEEP/$1"; then  # trained on another machine, its checkpoints lost: made again
    rm -rf "$OUT/$1.replay"  # (reproduce/replay_run.py: the same steps, each checked against the record)
    python reproduce/replay_run.py "$KEEP/$1" "$OUT/$1.replay"
    mv "$OUT/$1.replay" "$OUT/$1"
  fi
  if ! finished "$OUT/$1"; then echo "not evaluated yet: $1 has not finished training"; return; fi
  python eval.py "$OUT/$1" $EVAL
  mkdir -p "$KEEP/$1"
  cp "$OUT/$1"/{config.json,metrics.jsonl,eval-arith-2.json} "$KEEP/$1/"
  if [ -f "$OUT/$1/turns.jsonl" ]; then cp "$OUT/$1/turns.jsonl" "$KEEP/$1/"; fi  # TAKE_TURNS=1: when it computed
  EVALUATED+="$1 " EVAL_S=$((EVAL_S + $(date +%s) - began))
}

RUNS=()
plan() { RUNS+=("$1"); if [[ " $STAGES " == *" train "* ]]; then run "$@"; fi; }

start=$(date +%s)
if [ "$PLAN" = plateau ]; then
  for seed in $SEEDS; do  # methods interleaved within a seed, so a slow hour of the machine hits all alike
    if [[ " $COMPARISONS " == *" rollouts "* ]]; then
      plan grpo-n8-s$seed --seed $seed --rule none --n 8                    # 1: GRPO on all 8
      plan pods-n8-m4-s$seed --seed $seed --rule max_variance --n 8 --m 4   # 1: PODS keeps 4 of the same 8
    fi
    if [[ " $COMPARISONS " == *" updates "* ]]; then
      plan grpo-n4-s$seed --seed $seed --rule none --n 4                    # 2: GRPO on n = m = 4
      plan pods-n16-m4-s$seed --seed $seed --rule max_variance --n 16 --m 4 # 2: PODS keeps 4 of 16
    fi
    took_turns
  done
  for seed in $ABLATION_SEEDS; do  # after the comparisons: lower-powered
    plan maxreward-n8-m4-s$seed --seed $seed --rule max_reward --n 8 --m 4  # 4: the other rules
    plan random-n8-m4-s$seed --seed $seed --rule random --n 8 --m 4
    took_turns
  done
else
for seed in 0 1 2; do
  plan grpo-n8-s$seed --seed $seed --rule none --n 8                       # 1: GRPO on all 8
  plan pods-n8-m4-s$seed --seed $seed --rule max_variance --n 8 --m 4      # 1, 3: PODS keeps 4 of 8
  plan pods-n8-m2-s$seed --seed $seed --rule max_variance --n 8 --m 2      # 1, 2: PODS keeps 2 of 8
  if [ "$seed" -lt 2 ]; then
    plan maxreward-n8-m2-s$seed --seed $seed --rule max_reward --n 8 --m 2 # 2: the other rules
    plan random-n8-m2-s$seed --seed $seed --rule random --n 8 --m 2
    plan grpo-n4-s$seed --seed $seed --rule none --n 4                     # 3: n = m = 4
    plan pods-n16-m4-s$seed --seed $seed --rule max_variance --n 16 --m 4  # 3: PODS keeps 4 of 16
  fi
done
fi

if [[ " $STAGES " == *" eval "* ]]; then  # what is left to evaluate: comparison 1 first, then the others
  for name in "${RUNS[@]}"; do case $name in grpo-n8-*|pods-n8-*) evaluate "$name";; esac; done
  for name in "${RUNS[@]}"; do case $name in grpo-n8-*|pods-n8-*) ;; *) evaluate "$name";; esac; done
fi
evaluated=$(date +%s)

if [[ " $STAGES " == *" report "* ]]; then
  shopt -s nullglob  # a part-way report draws what has been evaluated; a comparison short of runs is named and left as it was
  plot() { local name=$1; shift; python reproduce/report.py "$@" --dataset $TASK --out "reproduce/cpu_$name.png" > "reproduce/cpu_$name.txt.new" \
             && mv "reproduce/cpu_$name.txt.new" "reproduce/cpu_$name.txt" && cat "reproduce/cpu_$name.txt" \
             || { rm -f "reproduce/cpu_$name.txt.new"; echo "not drawn yet: reproduce/cpu_$name (see the line above)"; }; }
  evaluated() { local dir; for dir in "$@"; do [ ! -f "$dir/eval-arith-2.json" ] || echo "$dir"; done; }  # (a run trained, not yet evaluated, waits)
  paired() {  # of a comparison's runs ($1: its two methods), those whose seed has a run of both, so the comparison
    # stays paired seed by seed: a seed whose other run is still training or waiting for its evaluation waits too
    local methods=$1 dir method whole; shift
    for dir in "$@"; do
      whole=1; for method in $methods; do [[ " $* " == *"/$method-s${dir##*-s} "* ]] || whole=0; done
      [ $whole = 0 ] || echo "$dir"
    done
  }
  if [ "$PLAN" = plateau ]; then
    # A wall-clock comparison needs every run on the same idle machine: seeds listed in
    # $KEEP/slower-machine-seeds.txt (their runs marked "slower machine" in the step-cost tables) are
    # left out of the tables and drawn with every seed beside them, in reproduce/cpu_plateau_*_all_seeds.
    SLOW_SEEDS=$(listed_seeds)
    ROLLOUTS="grpo-n8 pods-n8-m4" UPDATES="grpo-n4 pods-n16-m4"  # the two comparisons' methods
    plot plateau_equal_rollouts $(paired "$ROLLOUTS" $(evaluated $(idle "$KEEP"/grpo-n8-s* "$KEEP"/pods-n8-m4-s*)))
    plot plateau_equal_updates $(paired "$UPDATES" $(evaluated $(idle "$KEEP"/grpo-n4-s* "$KEEP"/pods-n16-m4-s*)))
    plot plateau_n_ablation $(evaluated $(idle "$KEEP"/grpo-n4-s* "$KEEP"/pods-n8-m4-s* "$KEEP"/pods-n16-m4-s*))
    plot plateau_rules $(evaluated $(idle "$KEEP"/pods-n8-m4-s[01] "$KEEP"/maxreward-n8-m4-s* "$KEEP"/random-n8-m4-s*)) --baseline "PODS max_variance n=8 m=4"
    if [ -n "${SLOW_SEEDS// }" ]; then
      rollouts=("$KEEP"/grpo-n8-s* "$KEEP"/pods-n8-m4-s*) updates=("$KEEP"/grpo-n4-s* "$KEEP"/pods-n16-m4-s*)
      plot plateau_equal_rollouts_all_seeds $(paired "$ROLLOUTS" $(evaluated "${rollouts[@]}"))
      plot plateau_equal_updates_all_seeds $(paired "$UPDATES" $(evaluated "${updates[@]}"))
      # Every evaluated seed on the reference clock (report.py --reference-runs): each step timed as the
      # unlisted seeds' machine took such a step, so runs from machines of other speeds compare
      reference=$(reference_runs)
      plot plateau_equal_rollouts_reference_clock $(paired "$ROLLOUTS" $(evaluated "${rollouts[@]}")) --reference-runs $reference
      plot plateau_equal_updates_reference_clock $(paired "$UPDATES" $(evaluated "${updates[@]}")) --reference-runs $reference
      # the check: the unlisted seeds alone on the clock, against their own clocks (the tables above)
      plot plateau_equal_rollouts_clock_check $(paired "$ROLLOUTS" $(evaluated $(idle "${rollouts[@]}"))) --reference-runs $reference
      plot plateau_equal_updates_clock_check $(paired "$UPDATES" $(evaluated $(idle "${updates[@]}"))) --reference-runs $reference
      # the seeds that trained the whole budget on the clock: the unlisted ones (the clock's own machine) and those
      # trained with CLOCK=reference, to their shortest run's horizon
      to_budget() { local dir; for dir in "$@"; do if [ -n "$(idle "$dir")" ] || by_clock "$dir"; then echo "$dir"; fi; done; }
      plot plateau_equal_rollouts_clock_to_budget $(paired "$ROLLOUTS" $(evaluated $(to_budget "${rollouts[@]}"))) --reference-runs $reference
      plot plateau_equal_updates_clock_to_budget $(paired "$UPDATES" $(evaluated $(to_budget "${updates[@]}"))) --reference-runs $reference
      # The primary reading of each comparison (reproduce/README.md, "The primary reading"): the to-budget seeds above,
      # read by reproduce/headline.py into the README's headline figure and the numbers behind its table
      python reproduce/headline.py --dataset $TASK --out reproduce/cpu_paired_differences.png --reference-runs $reference \
        --comparison "equal rollouts generated" $(paired "$ROLLOUTS" $(evaluated $(to_budget "${rollouts[@]}"))) \
        --comparison "equal rollouts updated" $(paired "$UPDATES" $(evaluated $(to_budget "${updates[@]}"))) > reproduce/cpu_primary.txt.new \
        && mv reproduce/cpu_primary.txt.new reproduce/cpu_primary.txt && cat reproduce/cpu_primary.txt \
        || { rm -f reproduce/cpu_primary.txt.new; echo "not drawn yet: reproduce/cpu_primary (see the line above)"; }
      # equal updates to a longer horizon (GRPO n=4 was still rising at 15 minutes): the seeds whose two runs
      # both reached LONG_BUDGET minutes on the clock (BUDGET=20 COMPARISONS=updates), to their shortest run's end
      reached() { local dir; for dir in "$@"; do if [ "$(BUDGET=$LONG_BUDGET clock "$dir" | cut -d' ' -f1)" = 0 ]; then echo "$dir"; fi; done; }
      LONG_BUDGET=${LONG_BUDGET:-20}
      plot plateau_equal_updates_clock_${LONG_BUDGET}min $(paired "$UPDATES" $(evaluated $(reached $(to_budget "${updates[@]}")))) --reference-runs $reference
      # the rules ablation of the seeds that trained the budget on the clock (ABLATION_SEEDS with CLOCK=reference; the
      # clock times max-reward and random with max-variance's line), against max-variance at the same seeds
      ablation=$(evaluated $(to_budget "$KEEP"/maxreward-n8-m4-s* "$KEEP"/random-n8-m4-s*))
      plot plateau_rules_clock_to_budget $(evaluated $(for dir in $ablation; do echo "$KEEP/pods-n8-m4-s${dir##*-s}"; done | sort -u)) \
        $ablation --reference-runs $reference --baseline "PODS max_variance n=8 m=4"
      # the same on the seeds where all three rules trained the budget (every rule paired seed by seed with
      # max-variance, to those seeds' own horizon: seed 0's max-reward run, on its own clock, ends it early above)
      RULES="pods-n8-m4 maxreward-n8-m4 random-n8-m4"
      plot plateau_rules_clock_paired $(paired "$RULES" $(evaluated $(to_budget "$KEEP"/pods-n8-m4-s* "$KEEP"/maxreward-n8-m4-s* "$KEEP"/random-n8-m4-s*))) \
        --reference-runs $reference --baseline "PODS max_variance n=8 m=4"
    fi
  else
  plot equal_rollouts $(evaluated "$KEEP"/grpo-n8-s* "$KEEP"/pods-n8-m4-s* "$KEEP"/pods-n8-m2-s*)
  plot rules $(evaluated "$KEEP"/pods-n8-m2-s[01] "$KEEP"/maxreward-n8-m2-s* "$KEEP"/random-n8-m2-s*) --baseline "PODS max_variance n=8 m=2"
  plot n_ablation $(evaluated "$KEEP"/grpo-n4-s* "$KEEP"/pods-n8-m4-s[01] "$KEEP"/pods-n16-m4-s*)
  fi
fi
if [[ " $STAGES " == *" train "* ]]; then
  echo "this invocation: training $(( (evaluated - start - EVAL_S) / 60 )) min, evaluation $(( EVAL_S / 60 )) min" | tee -a reproduce/cpu_time.txt
fi
exit
}
