#!/bin/bash
# Prepares vLLM 0.25.0 for a borrowed GPU machine (torch 2.11.0+cu130, Python 3.12, no network, no vLLM), where
# one device-tool `run` carries at most 64 MiB beside the working tree but /tmp survives between calls while the
# machine is held. Run here, in the checkout, where pip can download:
#   bash reproduce/gpu/carry-vllm/prepare.sh              # .gpu/vllm/part-00 ... and .gpu/vllm/manifest
#   bash reproduce/gpu/carry-vllm/prepare.sh --with-moe   # keep the MoE kernels (46 MB; needed only for MoE models)
#   bash reproduce/gpu/carry-vllm/prepare.sh --with-fa2   # keep FlashAttention 2 (191 MB; Ampere/Ada, ALiBi models)
#   PIECE_MIB=40 bash reproduce/gpu/carry-vllm/prepare.sh # smaller pieces (default: what fits beside the tree)
# (For its test: VLLM_PACK_ONLY=dir packs that directory instead, downloading nothing, into VLLM_OUT, in pieces
# of PIECE_BYTES.)
# It downloads the wheels that requirements.txt (beside this file) pins by hash, installs them here into a target
# directory as pip would there (cp312, manylinux x86_64), leaves out files an H100/H200 never loads, packs the
# directory as tar.xz and cuts it into equal pieces that each fit one call beside the working tree. There,
# receive.sh (one call per piece) verifies, assembles and unpacks it into /tmp/vllm-site. README.md beside this
# file has the sequence of calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
here=reproduce/gpu/carry-vllm
work=${VLLM_WORK:-/tmp/vllm-work/prepare}
out=${VLLM_OUT:-.gpu/vllm}
with_fa2=0 with_moe=0
for arg in "$@"; do
  case $arg in
    --with-fa2) with_fa2=1 ;;
    --with-moe) with_moe=1 ;;
    *) echo "prepare.sh: unknown argument $arg (known: --with-fa2, --with-moe; PIECE_MIB=N, VLLM_WORK=dir)" >&2; exit 2 ;;
  esac
done

if [[ -z ${VLLM_OUT:-} ]]; then
  # .gpu/ must be ignored by git: otherwise every piece would travel in every call (and break its 64 MiB)
  git check-ignore -q "$out/manifest" || echo "/.gpu/" >>"$(git rev-parse --git-path info/exclude)"
  git check-ignore -q "$out/manifest" || { echo "prepare.sh: $out is not ignored by git" >&2; exit 1; }
fi

platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
site=$work/site
if [[ -n ${VLLM_PACK_ONLY:-} ]]; then
  site=$VLLM_PACK_ONLY work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  full=$(du -sb "$site" | cut -f 1)
else
mkdir -p "$work/wheels"
python3 -m pip download -q --no-deps "${platform[@]}" --require-hashes -r "$here/requirements.txt" -d "$work/wheels"
# exactly the pinned files (an earlier run may have left other versions in the download folder)
wheels=()
while read -r spec; do
  name=${spec%%==*} version=${spec#*==}
  file=$(find "$work/wheels" -maxdepth 1 -iname "${name//-/_}-${version}-*.whl" | head -n 1)
  [[ -n $file ]] || { echo "prepare.sh: no wheel for $spec in $work/wheels" >&2; exit 1; }
  wheels+=("$file")
done < <(sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\) .*/\1/p' "$here/requirements.txt")

rm -rf "$site"
python3 -m pip install -q --no-deps --no-index --no-compile "${platform[@]}" --target "$site" "${wheels[@]}"
full=$(du -sb "$site" | cut -f 1)
# Left out: files this machine's Python and a Hopper GPU never load (README.md: how each was checked)
drop=(bin                                          # console scripts, with this machine's interpreter in them
      vllm/vllm-rs                                 # the Rust frontend of `vllm serve` (38 MB), not used by vllm.LLM
      xgrammar/lib                                 # libxgrammar.a, a static library for C++ builds (65 MB)
      vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so
      vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so)
((with_fa2)) || drop+=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so)  # FlashAttention 2: sm80-89; Hopper takes FA3
((with_moe)) || drop+=(vllm/_moe_C_stable_libtorch.abi3.so)     # MoE kernels; vLLM imports them only if present
for path in "${drop[@]}"; do
  [[ -e $site/$path ]] || { echo "prepare.sh: $path is not in the installed tree (another vLLM?)" >&2; exit 1; }
  rm -rf "${site:?}/$path"
done
find "$site" -name __pycache__ -prune -exec rm -rf {} +
fi
unpacked=$(du -sb "$site" | cut -f 1)

payload=$work/payload.tar.xz
echo "prepare.sh: packing $((unpacked >> 20)) MiB (of $((full >> 20)) MiB installed) with xz (5-6 minutes on 2 cores)"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$site" -cf - . | xz -6 -T0 >"$payload"
size=$(stat -c %s "$payload")
sum=$(sha256sum "$payload" | cut -d ' ' -f 1)

# pieces: what fits one call beside the working tree (tracked and untracked-not-ignored files), with margin
tree=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || true) | tail -n 1 | cut -f 1)
margin=$((6 << 20))   # for the tree growing before the pieces are carried, and the manifest
if [[ -n ${PIECE_MIB:-} ]]; then max=$((PIECE_MIB << 20)); else max=$(((64 << 20) - tree - margin)); fi
if [[ -n ${PIECE_BYTES:-} ]]; then
  max=$PIECE_BYTES
elif ((max <= 8 << 20 || tree + max + (1 << 20) >= 64 << 20)); then
  echo "prepare.sh: no room for pieces of $((max >> 20)) MiB beside the working tree ($((tree >> 20)) MiB)" >&2
  exit 1
fi
pieces=$(((size + max - 1) / max))
piece=$(((size + pieces - 1) / pieces))   # equal pieces, each under max

mkdir -p "$out"
rm -f "$out"/part-* "$out/manifest"
split -b "$piece" -d -a 2 "$payload" "$out/part-"
{
  echo "# vLLM payload for reproduce/gpu/carry-vllm/receive.sh, made by prepare.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "vllm 0.25.0"
  echo "fa2 $( ((with_fa2)) && echo kept || echo left-out)"
  echo "moe $( ((with_moe)) && echo kept || echo left-out)"
  echo "pieces $pieces"
  echo "payload $sum $size"
  echo "unpacked $unpacked"
  for part in "$out"/part-*; do
    echo "$(basename "$part") $(sha256sum "$part" | cut -d ' ' -f 1) $(stat -c %s "$part")"
  done
} >"$out/manifest"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "prepare.sh: payload $(mib "$size") (unpacks to $(mib "$unpacked")), $pieces pieces of $(mib "$piece") at most;"
echo "  working tree $(mib "$tree"): each call carries $(mib $((tree + piece))) of 64 MiB"
echo "Run, one device call each, back to back (the machine keeps /tmp only while calls follow within ~30 s):"
for part in "$out"/part-*; do
  echo "  run(command='bash $here/receive.sh', carry=['$part', '$out/manifest'])"
done
echo "The last one unpacks into /tmp/vllm-site and prints vllm.__version__; then: source $here/env.sh"
if [[ -z ${VLLM_PACK_ONLY:-} ]]; then
  echo "Its downloads and install stay in $work ($(du -sh "$work" | cut -f 1)): a rerun skips the download; delete it when done"
fi
