#!/usr/bin/env bash
# Times the whole `pipec compile` process (generate, lower, verify, write) at size L
# (interleaved-1f1b pp=64 vpp=8 M=1024, ~3.1M instructions) and at half and double the
# microbatches to show linear growth. Prints wall time, CPU time and peak RSS of each run.
# Usage: bench/compile-size-l.sh [--format json|bin]   (needs /usr/bin/time)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q -p pipec
fmt=${2:-json}
[ "${1:-}" = "--format" ] || fmt=json
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf '%-6s %9s %12s %9s %9s %9s\n' M instrs "wall s" "cpu s" "rss MiB" "MB out"
for m in 512 1024 2048; do
  best=""
  for run in 1 2 3; do
    rm -rf "$out/s"
    stats=$( { /usr/bin/time -f '%e %U %S %M' target/release/pipec compile --schedule interleaved-1f1b \
      --pp 64 --vpp 8 --microbatches "$m" --format "$fmt" -o "$out/s" >/dev/null; } 2>&1 | tail -1)
    read -r wall user sys rss <<<"$stats"
    cpu=$(echo "$user + $sys" | bc)
    if [ -z "$best" ] || [ "$(echo "$cpu < $(cut -d' ' -f2 <<<"$best")" | bc)" = 1 ]; then
      best="$wall $cpu $rss"
    fi
  done
  read -r wall cpu rss <<<"$best"
  instrs=$(python3 -c "import json;print(sum(r['instructions'] for r in json.load(open('$out/s/manifest.json'))['ranks']))")
  mb=$(du -sm "$out/s" | cut -f1)
  printf '%-6s %9s %12s %9s %9s %9s\n' "$m" "$instrs" "$wall" "$cpu" "$((rss / 1024))" "$mb"
done
