#!/bin/bash
# Receives vLLM 0.25.0 on a borrowed GPU machine, one piece per device call (prepare.sh made them here):
#   run(command='bash reproduce/gpu/carry-vllm/receive.sh', carry=['.gpu/vllm/part-00', '.gpu/vllm/manifest'])
#   ... the same with part-01, part-02, ... back to back
# Each call verifies the piece it finds in .gpu/vllm against the manifest and stores it in /tmp/vllm-recv; the
# call that completes the set checks the whole payload's sha256, unpacks it into /tmp/vllm-site and imports
# vLLM (check_imports.py). Idempotent and resumable: pieces already stored are skipped, pieces may come in any
# order, and once installed a call only re-checks the import. /tmp lasts only while the machine is held: a
# released machine starts bare, and then every piece must be carried again (the output names the missing ones).
# Exit status: 0 installed and importing; 10 pieces still missing; 2 no manifest; 3 a damaged piece;
# 4 the assembled payload does not match; 5 an import failed. Then: source reproduce/gpu/carry-vllm/env.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
here=reproduce/gpu/carry-vllm
src=${VLLM_PARTS:-.gpu/vllm}
recv=${VLLM_RECV:-/tmp/vllm-recv}
site=${VLLM_SITE:-/tmp/vllm-site}
manifest=$src/manifest
say() { echo "receive.sh: $*"; }

check() {  # the import check (VLLM_CHECK_CMD: another command, for the tests), with env.sh's environment
  VLLM_SITE=$site source "$here/env.sh" || return 5
  if [[ -n ${VLLM_CHECK_CMD:-} ]]; then bash -c "$VLLM_CHECK_CMD" || return 5
  else python3 "$here/check_imports.py" || return 5
  fi
  say "installed: source $here/env.sh (PYTHONPATH=$site, VLLM_USE_FLASHINFER_SAMPLER=0) before using vLLM"
}

if [[ ! -f $manifest ]]; then
  say "no $manifest: carry it with each piece (carry: ['.gpu/vllm/part-NN', '.gpu/vllm/manifest'])"
  if [[ -f $site/.vllm-payload ]]; then say "a payload is installed in $site; checking it"; check; exit; fi
  exit 2
fi
payload=$(awk '$1 == "payload" { print $2 }' "$manifest")
size=$(awk '$1 == "payload" { print $3 }' "$manifest")
parts=($(awk '$1 ~ /^part-[0-9]+$/ { print $1 }' "$manifest"))
[[ -n $payload && ${#parts[@]} -gt 0 ]] || { say "$manifest is not a manifest prepare.sh wrote"; exit 2; }

if [[ -f $site/.vllm-payload && $(cat "$site/.vllm-payload") == "$payload" ]]; then
  say "payload ${payload:0:12} is already installed in $site"
  check; exit
fi

# a store for this payload only: another build's pieces are dropped
if [[ -f $recv/manifest ]] && ! cmp -s "$recv/manifest" "$manifest"; then
  say "$recv held pieces of another payload: starting again"
  rm -rf "$recv"
fi
mkdir -p "$recv" && cp "$manifest" "$recv/manifest"

arrived=0 first=""
for piece in "$src"/part-*; do
  [[ -f $piece ]] || continue
  name=$(basename "$piece")
  want=$(awk -v n="$name" '$1 == n { print $2 }' "$manifest")
  if [[ -z $want ]]; then say "$name is not in the manifest: ignored"; continue; fi
  if [[ -f $recv/$name ]]; then say "$name: already here"; continue; fi  # verified when it was stored
  if [[ $(sha256sum "$piece" | cut -d ' ' -f 1) != "$want" ]]; then
    say "$name: its sha256 is not the manifest's: a damaged copy, or a piece of another build (run prepare.sh again)"
    exit 3
  fi
  cp "$piece" "$recv/$name.tmp" && mv "$recv/$name.tmp" "$recv/$name" || { say "$name: could not store it in $recv"; exit 3; }
  say "$name: stored"
  arrived=$((arrived + 1)) first=${first:-$name}
done

missing=()
for name in "${parts[@]}"; do [[ -f $recv/$name ]] || missing+=("$name"); done
if ((${#missing[@]})); then
  say "have $((${#parts[@]} - ${#missing[@]})) of ${#parts[@]} pieces; still to carry: ${missing[*]}"
  if ((arrived > 0 && ${#parts[@]} - ${#missing[@]} == arrived)) && [[ ${missing[0]} < $first ]]; then
    say "(no piece carried before this call is here: if they were, the machine was released and /tmp is new)"
  fi
  exit 10
fi

say "all ${#parts[@]} pieces here: checking the payload ($((size >> 20)) MiB) and unpacking it into $site"
start=$SECONDS
whole=$recv/payload.tar.xz
cat "${parts[@]/#/$recv/}" >"$whole"
if [[ $(sha256sum "$whole" | cut -d ' ' -f 1) != "$payload" ]]; then
  say "the assembled payload's sha256 is not the manifest's: starting again (carry every piece anew)"
  rm -rf "$recv"
  exit 4
fi
rm -rf "$site.new" && mkdir -p "$site.new"
python3 - "$whole" "$site.new" <<'EOF' || { say "could not unpack $whole"; rm -rf "$site.new"; exit 4; }
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    tar.extractall(sys.argv[2], filter="data")
EOF
echo "$payload" >"$site.new/.vllm-payload"
rm -rf "$site" && mv "$site.new" "$site"
rm -f "$recv"/part-* "$whole"  # the marker in $site now says it is installed
say "unpacked $(du -sm "$site" | cut -f 1) MiB in $((SECONDS - start)) s"
check
