#!/usr/bin/env bash
# Times the whole `pipec compile` process (generate, lower, verify, write) at size L
# (interleaved-1f1b pp=64 vpp=8 M=1024, ~3.1M instructions), at half, double and four times
# the microbatches to show linear growth, and zb-v / dualpipe-v at pp=64 M=1024; then
# `pipec check` (load, hash, verify) of each interleaved output. Prints the median wall time,
# CPU time (user + sys) and peak RSS of 5 runs (3 above M=1024) and the output size.
# Usage: [PIPEC=binary] bench/compile-size-l.sh [--format json|bin]   (needs /usr/bin/time)
# The output goes under $BENCH_DIR (default: a fresh directory in $TMPDIR or /tmp); the
# filesystem matters at these sizes (see docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q -p pipec-cli
fmt=json
if [ "${1:-}" = "--format" ]; then fmt=${2:-json}; fi
out=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/pipec-bench.XXXXXX")
trap 'rm -rf "$out"' EXIT
pipec=${PIPEC:-target/release/pipec}

# median WALL CPU RSS_MIB of N runs of a command; PRE runs before each, untimed.
measure() {
  local n=$1 pre=$2; shift 2
  local rows=()
  for _ in $(seq "$n"); do
    eval "$pre"
    /usr/bin/time -o "$out/time" -f '%e %U %S %M' "$@" >/dev/null 2>&1
    rows+=("$(tail -1 "$out/time")")
  done
  printf '%s\n' "${rows[@]}" | awk '{w[NR]=$1; c[NR]=$2+$3; r[NR]=$4}
    function med(a, n,  i, j, t) { for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }; return a[int((n + 1) / 2)] }
    END { printf "%.2f %.2f %d\n", med(w, NR), med(c, NR), med(r, NR) / 1024 }'
}

uptime
printf '%-24s %9s %8s %8s %8s %7s %8s %8s\n' schedule instrs "wall s" "cpu s" "rss MiB" "MB out" "check s" "chk MiB"
for spec in "interleaved-1f1b 8 512" "interleaved-1f1b 8 1024" "interleaved-1f1b 8 2048" \
    "interleaved-1f1b 8 4096" "zb-v 2 1024" "dualpipe-v 2 1024"; do
  read -r kind vpp m <<<"$spec"
  runs=5
  [ "$m" -gt 1024 ] && runs=3
  args=(compile --schedule "$kind" --pp 64 --vpp "$vpp" --microbatches "$m" --format "$fmt" -o "$out/s")
  read -r wall cpu rss <<<"$(measure "$runs" 'rm -rf "$out/s"; sync' "$pipec" "${args[@]}")"
  instrs=$(python3 -c "import json;print(sum(r['instructions'] for r in json.load(open('$out/s/manifest.json'))['ranks']))")
  mb=$(du -sm "$out/s" | cut -f1)
  read -r cwall _ crss <<<"$(measure "$runs" ':' "$pipec" check "$out/s")"
  printf '%-24s %9s %8s %8s %8s %7s %8s %8s\n' "$kind M=$m" "$instrs" "$wall" "$cpu" "$rss" "$mb" "$cwall" "$crss"
done
uptime
