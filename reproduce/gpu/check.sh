#!/bin/bash
# The project's GPU check: the CUDA tests, then the default GPU profile's step (train.py, PODS and GRPO) against
# TRL's GRPOTrainer on the same model and configuration, side by side with the card, date and commit. From the
# repository root, on a CUDA machine with the GPU set installed (reproduce/gpu/README.md):
#   bash reproduce/gpu/check.sh                      # every stage, 8 minutes at most (BUDGET=480 seconds)
#   TOKENS=128 bash reproduce/gpu/check.sh pods trl  # the stages named, at 128 new tokens: a quick look
# Stages, run in this order (name some to run only those):
#   tests  python -m pytest -m cuda: the CUDA tests (TESTS: only those pytest -k selects, e.g. TESTS=vllm)
#   decode the transformers sampler's decode step, ms at 32 rows and at most 256 tokens: CUDA graph, eager, .gpu/old's
#   pods   train.py --backend hf --n 32 --m 16 (PODS, the default command's GPU profile): 3 steps, 2-3 timed
#   old    the same in .gpu/old, an older commit's tree (prepare.sh with OLD=COMMIT): a regression's baseline
#   trl    TRL's GRPOTrainer, GRPO n=32, on the same model and configuration (trl_gpu.py)
#   grpo   train.py --rule none (GRPO on all 32): like for like against TRL
#   vllm   the pods stage with --backend vllm, where vLLM imports (else skipped, saying so)
# MODEL: what the timed stages train (default Qwen/Qwen2.5-3B-Instruct, a local directory or a hub name in the
# hub's cache; where it is neither, or MODEL=random, random weights at its shape: make_models.py). DATASET: what
# train.py --dataset takes (default .gpu/gsm8k-train.jsonl where prepare.sh put it, else gsm8k from the hub).
# Each stage may take its SHARE of BUDGET (the last one all that is left) and no more than is left of it; one stopped
# there reports the steps it finished.
# OUT (default runs/gpu-check) receives last_check.txt (the summary), check.log (all printed here) and logs.tar.gz
# (each stage's log and metrics); WORK (default /tmp/pods-gpu-check) holds the models, runs and logs. WHEELS (default
# .gpu/whl, from prepare.sh) is installed into WORK/site where its versions are not those installed.
set -u
cd "$(dirname "$0")/../.." || exit 1
ORDER=(tests decode pods old trl grpo vllm)
declare -A SHARE=([tests]=35 [decode]=20 [pods]=23 [old]=23 [trl]=40 [grpo]=23 [vllm]=38)  # % of BUDGET a stage may take, at most
for stage in "$@"; do
  [[ " ${ORDER[*]} " == *" $stage "* ]] || { echo "check.sh: unknown stage '$stage'; choose from: ${ORDER[*]}" >&2; exit 2; }
done
stages=()  # those named, or every one (old where prepare.sh made .gpu/old), in ORDER's order
for stage in "${ORDER[@]}"; do
  [[ " $* " == *" $stage "* || ($# == 0 && ($stage != old || -d .gpu/old)) ]] && stages+=("$stage")
done
TOKENS=${TOKENS:-512} BUDGET=${BUDGET:-480} MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
OUT=${OUT:-runs/gpu-check} WORK=${WORK:-/tmp/pods-gpu-check} HERE=$PWD/reproduce/gpu
LOGS=$WORK/logs DATASET=${DATASET:-gsm8k}
[[ $DATASET == gsm8k && -f .gpu/gsm8k-train.jsonl ]] && DATASET=.gpu/gsm8k-train.jsonl
[[ -f $DATASET ]] && DATASET=$(realpath "$DATASET")  # the old stage runs in .gpu/old
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
rm -rf "$LOGS" "$WORK/runs"; mkdir -p "$OUT" "$LOGS" "$WORK/runs"
exec > >(tee "$OUT/check.log") 2>&1
tee_pid=$!
start=$SECONDS
say() { echo "=== [$((SECONDS - start)) s] $*"; }
installed() {  # "NAME VERSION" for each distribution named, "NAME absent" where it is not installed
  python3 -c 'import importlib.metadata as m, sys
for name in sys.argv[1:]:
    try: print(name, m.version(name))
    except m.PackageNotFoundError: print(name, "absent")' "$@"
}

say "setup: stages ${stages[*]}; $TOKENS new tokens; BUDGET $BUDGET s"
WHEELS=${WHEELS:-.gpu/whl}
if [[ -d $WHEELS ]]; then  # prepared by prepare.sh for a machine without the hub and without the GPU set's packages
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
  wheels=("$WHEELS"/*.whl) wanted=()
  for wheel in "${wheels[@]}"; do IFS=- read -r name version _ <<<"${wheel##*/}"; wanted+=("$name $version"); done
  if [[ $(installed "${wanted[@]%% *}") != "$(printf '%s\n' "${wanted[@]}")" ]]; then
    echo "installing from $WHEELS into $WORK/site: ${wanted[*]}"
    rm -rf "$WORK/site"  # afresh: pip --target --upgrade leaves the older version's dist-info, which metadata then reports
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "${wheels[@]}" || exit 1
  fi
fi
card=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { echo "check.sh: torch sees no CUDA GPU here; this check needs one"; exit 1; }
without_vllm=${PYTHONPATH:-}  # the trl stage's: TRL imports the vLLM it finds (its paths for 0.25 never ran on a GPU), which it does not use here
source "$HERE/carry-vllm/env.sh" 2>/dev/null  # vLLM 0.25.0 where reproduce/gpu/carry-vllm/receive.sh unpacked it (carry-vllm/README.md)
# found, not imported (importing vLLM takes ~30 s); the vllm stage and the vLLM tests say so where it does not import
python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null && has_vllm=yes || has_vllm=
[[ $has_vllm ]] && SHARE[tests]=60  # the tests start vLLM three times (2-3 minutes each on an H100 or H200, 28 November)
if [[ " ${stages[*]} " == *" tests "* ]] && line=$(python3 "$HERE/make_models.py" embedded "$WORK/cache"); then  # the CUDA tests' model, in PODS_CACHE
  PODS_CACHE=$(dirname "${line%%$'\t'*}") embedded_what=${line#*$'\t'}
  export PODS_CACHE
fi
if [[ ${stages[*]} != tests ]]; then  # the timed stages' model, built (if random) while the tests run
  python3 "$HERE/make_models.py" policy "$MODEL" "$WORK/qwen3b-shape" >"$LOGS/model.txt" 2>"$LOGS/models.log" &
  building=$!
fi
model_ready() {  # true once make_models.py has given the timed stages' model
  if [[ ${building:-} ]]; then
    wait "$building" && IFS=$'\t' read -r model_dir model_what <"$LOGS/model.txt"
    building=
    say "model: ${model_what:-none: $(tail -n 1 "$LOGS/models.log")}"
  fi
  [[ ${model_dir:-} ]]
}
skip() { printf '%s\tskipped\t%s\n' "$1" "$2" >>"$LOGS/status.txt"; say "$1 skipped: $2"; }
run_stage() {  # run_stage STAGE COMMAND...: within its share of BUDGET (the last stage: all) and what is left (20 s kept for the summary)
  local stage=$1 limit=$((BUDGET - (SECONDS - start) - 20)) began=$SECONDS code
  shift
  [[ $stage != "${stages[-1]}" ]] && ((limit > BUDGET * SHARE[$stage] / 100)) && limit=$((BUDGET * SHARE[$stage] / 100))
  ((limit < 30)) && { skip "$stage" "no time left of BUDGET=$BUDGET s"; return; }
  say "$stage, at most $limit s: $*"
  timeout -k 15 $((limit - 15)) "$@" >"$LOGS/$stage.log" 2>&1  # SIGTERM: train.py finishes its step; KILL 15 s later
  code=$?
  printf '%s\t%s\t%s\n' "$stage" "$code" "$((SECONDS - began))" >>"$LOGS/status.txt"
  [[ -f $WORK/runs/$stage/metrics.jsonl ]] && cp "$WORK/runs/$stage/metrics.jsonl" "$LOGS/$stage.jsonl"
  tail -n 2 "$LOGS/$stage.log"
  write_env
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs  # after every stage: a call the device tool kills at its limit still returns them
}
train() {  # train STAGE DIR FLAGS...: train.py of the checkout in DIR for 3 steps, its GPU profile on the model
  model_ready || { skip "$1" "no model to train (models.log)"; return; }
  run_stage "$1" env -C "$2" python3 "$HERE/peak.py" --model "$model_dir" --dataset "$DATASET" --max-new-tokens "$TOKENS" \
    --steps 3 --out-dir "$WORK/runs/$1" "${@:3}"
}
if [[ -f .gpu/commit ]]; then  # a borrowed machine's copy of the checkout may hold another git state than the one carried
  commit="$(cat .gpu/commit) (as prepare.sh recorded it)"
elif commit=$(git rev-parse --short HEAD 2>/dev/null); then
  [[ $(git status --porcelain 2>/dev/null) ]] && commit+=" with uncommitted changes"
else
  commit=unknown
fi
versions=$(installed torch transformers peft trl vllm | paste -sd, | sed 's/,/, /g')
write_env() {  # the summary's header, LOGS/env.txt: written after every stage, with what is known by then
  {
    echo "card: ${card:-unknown (no nvidia-smi)}"
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $commit"
    echo "versions: $versions"
    echo "model: ${model_what:-none (no timed stage yet)}"
    echo "tests' model: ${embedded_what:-none}"
    echo "configuration: 1 prompt x 32 rollouts a step, PODS keeping 16; $TOKENS new tokens; 3 steps; the GPU profile's defaults"
    [[ " ${stages[*]} " == *" old "* && -f .gpu/old/commit ]] && echo "old: $(cat .gpu/old/commit)"
  } >"$LOGS/env.txt"
}

for stage in "${stages[@]}"; do
  case $stage in
    tests) run_stage tests python3 -m pytest -v -rfEs -m cuda -s -p no:cacheprovider ${TESTS:+-k "$TESTS"} ;;  # -v: each test named as it starts
    decode) model_ready || { skip decode "no model to time (models.log)"; continue; }
           old_tree=(); [[ -d .gpu/old ]] && old_tree=(--old .gpu/old)
           run_stage decode python3 "$HERE/decode_bench.py" --model "$model_dir" --tokens $((TOKENS < 256 ? TOKENS : 256)) "${old_tree[@]}" ;;  # eager steps: 85 ms
    pods)  train pods . --backend hf --n 32 --m 16 ;;
    old)   if [[ -d .gpu/old ]]; then train old .gpu/old --backend hf --n 32 --m 16
           else skip old "no .gpu/old: run prepare.sh with OLD=COMMIT first"; fi ;;
    trl)   model_ready || { skip trl "no model to train (models.log)"; continue; }
           run_stage trl env PYTHONPATH="$without_vllm" python3 "$HERE/trl_gpu.py" --model "$model_dir" --dataset "$DATASET" --n 32 \
             --max-new-tokens "$TOKENS" --steps 3 --out-dir "$WORK/runs/trl" ;;
    grpo)  train grpo . --backend hf --rule none --n 32 ;;
    vllm)  if [[ $has_vllm ]]; then train vllm . --backend vllm --n 32 --m 16; else skip vllm "vLLM does not import here"; fi ;;
  esac
done

say "summary: $OUT/last_check.txt"
write_env
python3 "$HERE/summary.py" "$LOGS" | tee "$OUT/last_check.txt"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
exec >&- 2>&-
wait "$tee_pid"  # check.log whole before the command returns
