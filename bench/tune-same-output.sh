#!/usr/bin/env bash
# Byte-identity of two pipec builds' `tune`: the --json report (less its `seconds`, the wall
# time of the search), the text report (less its "in N s" line) and every file `tune -o`
# writes, over targets, memory limits, layouts, cost files and sizes up to pp=64, M=1024.
# Usage: bench/tune-same-output.sh OLD_PIPEC NEW_PIPEC   (prints the cases that differ)
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2")
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/heavy.cost" <<'COST'
E.f = 3
E.b = 6
L.f = 4
L.b = 8
t.f = 1
t.b = 1.2
t.w = 0.9
p2p = 0.1
COST
cat >"$tmp/bytes.cost" <<'COST'
[model]
hidden = 4096
ffn = 14336
heads = 32
kv_heads = 8
seq = 4096
micro_batch = 1
vocab = 128256
dtype = "bf16"
tp = 2
COST
cases=(
  "--pp 2 --microbatches 4 --num-layers 4"
  "--pp 4 --microbatches 8 --num-layers 8"
  "--pp 4 --microbatches 8 --num-layers 8 --target any"
  "--pp 4 --microbatches 16 --num-layers 12 --target megatron"
  "--pp 4 --microbatches 16 --num-layers 12 --target torch"
  "--pp 4 --microbatches 16 --num-layers 12 --target torchtitan"
  "--pp 4 --microbatches 16 --num-layers 12 --target pipec-run"
  "--pp 4 --microbatches 8 --num-layers 8 --memory-limit 4 --target any"
  "--pp 8 --microbatches 16 --num-layers 16 --target any --cost-file HEAVY"
  "--pp 8 --microbatches 32 --num-layers 30 --cost-file HEAVY --memory-limit 12"
  "--pp 8 --microbatches 64 --num-layers 32"
  "--pp 8 --microbatches 64 --num-layers 32 --target any"
  "--pp 8 --microbatches 16 --layout Et|t|t|t|t|t|t|tL --target any"
  "--pp 4 --microbatches 8 --layout Ett|tt|tt|ttL --rebalance --target any"
  "--pp 8 --microbatches 16 --num-layers 32 --cost-file BYTES --memory-limit 60GiB"
  "--pp 8 --microbatches 16 --num-layers 32 --cost-file BYTES --target any"
  "--pp 16 --microbatches 32 --num-layers 32 --target any"
  "--pp 16 --microbatches 64 --num-layers 60 --kinds tuned,zb-v,1f1b"
  "--pp 32 --microbatches 128 --num-layers 64 --target any"
  "--pp 64 --microbatches 256 --num-layers 126 --target any"
  "--pp 8 --microbatches 32 --num-layers 30 --cost-file HEAVY --target deepspeed"
  "--pp 4 --microbatches 32 --layout Ettt|tt|tt|ttL --rebalance --cost-file HEAVY --target any"
  "--pp 16 --microbatches 48 --num-layers 40 --cost-file HEAVY --memory-limit 20 --target any"
  "--pp 64 --microbatches 1024 --num-layers 126"
  "--pp 64 --microbatches 1024 --num-layers 126 --target any"
)
differ=0
for i in "${!cases[@]}"; do
  c=${cases[$i]//HEAVY/$tmp/heavy.cost}
  c=${c//BYTES/$tmp/bytes.cost}
  for side in old new; do
    bin=${!side}
    mkdir -p "$tmp/$side"
    (
      cd "$tmp/$side"
      # shellcheck disable=SC2086
      "$bin" tune $c --json 2>&1 | sed -E 's/"seconds": *[0-9.e+-]+/"seconds": 0/' >"$i.json" || true
      # shellcheck disable=SC2086
      "$bin" tune $c -o "$i.dir" 2>&1 | sed -E 's/ in [0-9.]+m?s:/ in -:/' >"$i.txt" || true
    )
  done
  if ! diff -r "$tmp/old" "$tmp/new" >/dev/null; then
    echo "differs: ${cases[$i]}" && differ=1
    # `|| true`: under pipefail a closed pipe (head) would end the script at the first case.
    diff -r "$tmp/old" "$tmp/new" | head -10 || true
  fi
  rm -rf "$tmp/old" "$tmp/new"
done
echo "${#cases[@]} tune cases compared; $([ $differ = 0 ] && echo all identical || echo SOME DIFFER)"
exit $differ
