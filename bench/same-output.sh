#!/usr/bin/env bash
# Byte-identity of two pipec builds over a grid: every schedule kind (with its placements and
# Megatron P2P modes), both encodings, and the views and exports read from the result.
# Usage: bench/same-output.sh OLD_PIPEC NEW_PIPEC   (prints one line per case that differs)
set -euo pipefail
old=$1 new=$2
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
cases=(
  "--schedule gpipe --pp 4 --microbatches 8"
  "--schedule 1f1b --pp 4 --microbatches 8"
  "--schedule 1f1b --pp 4 --microbatches 8 --combined"
  "--schedule 1f1b --pp 3 --microbatches 7 --megatron-p2p unbatched"
  "--schedule interleaved-1f1b --pp 4 --vpp 2 --microbatches 8"
  "--schedule interleaved-1f1b --pp 4 --vpp 3 --microbatches 12 --group-size 6"
  "--schedule interleaved-1f1b --pp 2 --vpp 2 --microbatches 4"
  "--schedule interleaved-1f1b --pp 4 --vpp 2 --microbatches 8 --megatron-p2p overlap"
  "--schedule interleaved-1f1b --pp 4 --vpp 2 --microbatches 8 --megatron-p2p overlap-flush-keep-outputs"
  "--schedule interleaved-1f1b --pp 4 --vpp 2 --microbatches 8 --forward-only"
  "--schedule looped-bfs --pp 4 --vpp 2 --microbatches 8"
  "--schedule zb-h1 --pp 4 --microbatches 8"
  "--schedule zb-h2 --pp 4 --microbatches 8"
  "--schedule zb-1p --pp 4 --microbatches 8"
  "--schedule zb-v --pp 4 --microbatches 8"
  "--schedule dualpipe-v --pp 4 --microbatches 8"
  "--schedule dualpipe --pp 4 --microbatches 8"
  "--schedule interleaved-1f1b --pp 4 --microbatches 8 --layout Et|t|t|t|t|t|t|tL"
  "--schedule interleaved-1f1b --pp 16 --vpp 4 --microbatches 64"
)
differ=0
mkdir -p "$tmp/old" "$tmp/new"
for i in "${!cases[@]}"; do
  c=${cases[$i]}
  for fmt in json bin; do
    for side in old new; do
      bin=$(realpath "${!side}")
      # Relative paths inside one directory per side, so messages naming them agree.
      (
        cd "$tmp/$side"
        d="$i-$fmt"
        # shellcheck disable=SC2086
        "$bin" compile $c --format "$fmt" -o "$d" >"$d.compile.txt" 2>&1 || echo "exit $?" >>"$d.compile.txt"
        [ "$fmt" = json ] || exit 0
        "$bin" show "$d" >"$d.show.txt" 2>&1 || true
        "$bin" simulate "$d" --json >"$d.sim.json" 2>&1 || true
        "$bin" check "$d" >"$d.check.txt" 2>&1 || true
        for e in chrome-trace svg dot torch-csv; do
          "$bin" export "$d" --format "$e" -o "$d.$e" >/dev/null 2>&1 || echo missing >"$d.$e"
        done
      )
    done
  done
done
if ! diff -r "$tmp/old" "$tmp/new" >"$tmp/diff.txt"; then
  differ=1 && head -40 "$tmp/diff.txt"
fi
n=$(find "$tmp/old" -type f | wc -l)
echo "$n files compared over ${#cases[@]} cases, json and bin; $([ $differ = 0 ] && echo all identical || echo SOME DIFFER)"
exit $differ
