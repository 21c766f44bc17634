#!/bin/bash
# Prepares a GPU check (check.sh) for a borrowed machine: torch + CUDA and Python 3.12 there, but not the GPU set's
# transformers, peft, trl or datasets, no vLLM, no model hub and no network. Run here, in the checkout, where pip
# can download; it fills .gpu/ (ignored by git through .git/info/exclude), which travels beside the checkout:
#   bash reproduce/gpu/prepare.sh                  # .gpu/: the wheels, SmolLM2's tokenizer, GSM8K's training file
#   OLD=5af2948 bash reproduce/gpu/prepare.sh      # also that commit's tree in .gpu/old: check.sh times it too
# In .gpu/: whl/ (transformers and peft as requirements-gpu.txt pins them, trl as requirements-trl.txt does, and
# datasets with the two of its needs such an image lacks; TRANSFORMERS=5.24.0 takes another transformers, and
# WHEELS=.gpu/whl-5.24 puts the wheels there instead, for check.sh's WHEELS), smol/
# (SmolLM2-135M-Instruct's tokenizer and config, from the embedded model, converted once by
# python -c "import model; model.embedded_model_dir()"), gsm8k-train.jsonl (GSM8K=path, default
# ../shared/data/gsm8k/train.jsonl beside the checkout; never commit it) and commit (HEAD, as git has it here).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude
pin() { sed -n "s/^$1==//p" "$2"; }
transformers=${TRANSFORMERS:-$(pin transformers requirements-gpu.txt)} WHEELS=${WHEELS:-.gpu/whl}
peft=$(pin peft requirements-gpu.txt) trl=$(pin trl requirements-trl.txt)
smol=${PODS_CACHE:-$HOME/.cache/pods}/SmolLM2-135M-Instruct
gsm8k=${GSM8K:-../shared/data/gsm8k/train.jsonl}
[[ -f $smol/config.json ]] || { echo "prepare.sh: no $smol: convert the embedded model once: python -c 'import model; model.embedded_model_dir()'" >&2; exit 1; }
[[ -f $gsm8k ]] || { echo "prepare.sh: no GSM8K training file at $gsm8k: pass GSM8K=path/to/train.jsonl" >&2; exit 1; }

rm -rf "$WHEELS" .gpu/smol .gpu/old && mkdir -p "$WHEELS" .gpu/smol
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$WHEELS" "transformers==$transformers" "peft==$peft" "trl==$trl" datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
find "$smol" -maxdepth 1 -type f ! -name "*.safetensors" -exec cp {} .gpu/smol/ \;
cp "$gsm8k" .gpu/gsm8k-train.jsonl
echo "$(git rev-parse --short HEAD)$([[ -z $(git status --porcelain) ]] || echo " with uncommitted changes")" >.gpu/commit
if [[ ${OLD:-} ]]; then  # the older commit's files at the root (train.py and what it imports), not a worktree
  mkdir .gpu/old
  git archive "$OLD" ':(glob)*.py' | tar -x -C .gpu/old
  git rev-parse --short "$OLD" >.gpu/old/commit
fi

ls "$WHEELS"
tree=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || true) | tail -n 1 | cut -f 1)
carry=("$WHEELS" .gpu/smol .gpu/gsm8k-train.jsonl .gpu/commit)
[[ -d .gpu/old ]] && carry+=(.gpu/old)
gpu=$(du -cb "${carry[@]}" | tail -n 1 | cut -f 1)
echo "carry: ${carry[*]}: $((gpu >> 20)) MiB; with the working tree $(((tree + gpu) >> 20)) MiB travel (the device tool carries 64 MiB)"
