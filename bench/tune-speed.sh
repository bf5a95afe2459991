#!/usr/bin/env bash
# Issue #28's tune timings, two builds alternated in one run (so a slow spell of a shared
# machine hits both alike): wall, CPU (user + system) and peak RSS of each command, ROUNDS
# times per build, old then new, command after command.
# Usage: bench/tune-speed.sh OLD_PIPEC NEW_PIPEC [ROUNDS=3]
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2") rounds=${3:-3}
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
cmds=(
  "compile --schedule zb-v --pp 64 --microbatches 1024 --num-layers 128 -o $tmp/c"
  "tune --pp 64 --microbatches 1024 --num-layers 126"
  "tune --pp 64 --microbatches 1024 --num-layers 126 --target any"
  "tune --pp 4000 --microbatches 8 --num-layers 4000"
  "tune --pp 8 --microbatches 64 --num-layers 32"
  "tune --pp 8 --microbatches 64 --num-layers 32 --target any"
)
for c in "${cmds[@]}"; do
  echo "== $c"
  for _ in $(seq "$rounds"); do
    for side in old new; do
      rm -rf "$tmp/c"
      # shellcheck disable=SC2086
      /usr/bin/time -f "$side %e s wall, %U+%S s CPU, %M KB" "${!side}" $c >/dev/null 2>"$tmp/err" ||
        { cat "$tmp/err"; exit 1; }
      tail -1 "$tmp/err"
    done
  done
done
