#!/usr/bin/env bash
# A/B timing of whole commands on a noisy machine: runs each command in turn, ROUNDS times
# (so a slow spell hits every variant alike), `sync` and a scratch directory removed before
# each run, and prints the median, min and max wall time per label.
# Usage: bench/ab.sh ROUNDS 'label=command' ...   (the command may write to $AB_OUT)
# Example: bench/ab.sh 9 "old=$OLD compile --schedule zb-v --pp 64 --microbatches 1024 -o \$AB_OUT" \
#                        "new=$NEW compile --schedule zb-v --pp 64 --microbatches 1024 -o \$AB_OUT"
set -euo pipefail
rounds=$1
shift
AB_OUT=$(mktemp -d "${TMPDIR:-/tmp}/pipec-ab.XXXXXX")
export AB_OUT
trap 'rm -rf "$AB_OUT"' EXIT
declare -A times
for _ in $(seq "$rounds"); do
  for spec in "$@"; do
    label=${spec%%=*}
    rm -rf "$AB_OUT" && sync
    start=$(date +%s%N)
    eval "${spec#*=}" >/dev/null 2>&1 || echo "warning: $label exited $?" >&2
    end=$(date +%s%N)
    times[$label]+="$(((end - start) / 1000000)) "
  done
done
for spec in "$@"; do
  label=${spec%%=*}
  printf '%s\n' ${times[$label]} | sort -n | awk -v l="$label" '{a[NR] = $1}
    END { printf "%-12s median %.3f s  min %.3f  max %.3f\n", l, a[int((NR + 1) / 2)] / 1000, a[1] / 1000, a[NR] / 1000 }'
done
