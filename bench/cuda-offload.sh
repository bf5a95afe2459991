#!/usr/bin/env bash
# Memory instructions on the CUDA backend (issue 30), in one go on a GPU machine:
#   1. the GPU tests of tests/integration/cuda_memory.rs (--check against the CPU reference,
#      the copy order in the CUDA-event trace, peaks);
#   2. the same 1F1B (pp=4, M=16, 16 decoder layers, one GPU) plain, with the tuner's offloads
#      (`pipec tune --target pipec-run --memory-limit 10`: the copy stream) and with its
#      recomputes instead, at the size of docs/cuda.md's benchmark (bf16, hidden 4096):
#      step wall time, each GPU's memory-pool peak, and per rank the copy time hidden under
#      compute against the exposed part (`pipec-run`'s "copies" lines).
#
#   bench/cuda-offload.sh                      # builds with cargo, runs everything
#   BIN=/path/to/release bench/cuda-offload.sh # prebuilt pipec and pipec-run (no toolchain);
#       TEST_BIN=/path/to/integration-<hash> also runs the GPU tests with them
#   BACKEND=cpu bench/cuda-offload.sh          # the same steps on the CPU at a tiny size (the
#       script's own plumbing; no GPU figures)
#
# Output under OUT (default /tmp/pipec-offload): DIR.txt (pipec-run's report),
# DIR.trace.json (Chrome trace with the `rank R copy` rows), summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-cuda}
OUT=${OUT:-/tmp/pipec-offload}
mkdir -p "$OUT"

if [ -z "${BIN:-}" ]; then
  features=()
  [ "$BACKEND" = cuda ] && features=(--features cuda)
  cargo build --release -p pipec-cli "${features[@]}"
  BIN=target/release
fi

if [ "$BACKEND" = cuda ]; then
  "$BIN/pipec-run" --cuda-info
  if [ -n "${TEST_BIN:-}" ]; then
    PIPEC_CUDA_RUN_BIN=$PWD/$BIN/pipec-run "$TEST_BIN" cuda_memory --ignored --test-threads 1
  elif command -v cargo >/dev/null; then
    cargo test -p pipec-tests --features cuda --test integration cuda_memory -- --ignored --test-threads 1
  fi
  SIZE=(--backend cuda --dtype bf16 --hidden 4096 --ffn 16384 --vocab 32768 --seq 4096 --steps 3)
else
  SIZE=(--hidden 64 --ffn 128 --vocab 96 --seq 16 --steps 2 --check)
fi

tune=(--pp 4 --microbatches 16 --layout 'Et*4|(t*4|)*2,t*4,L' --kinds 1f1b --target pipec-run)
"$BIN/pipec" tune "${tune[@]}" --no-offload --no-recompute -o "$OUT/plain" >"$OUT/plain.tune.txt"
"$BIN/pipec" tune "${tune[@]}" --memory-limit 10 --no-recompute -o "$OUT/offload" >"$OUT/offload.tune.txt"
"$BIN/pipec" tune "${tune[@]}" --memory-limit 10 --no-offload -o "$OUT/recompute" >"$OUT/recompute.tune.txt"

: >"$OUT/summary.txt"
for p in plain offload recompute; do
  "$BIN/pipec-run" "$OUT/$p" "${SIZE[@]}" --trace "$OUT/$p.trace.json" | tee "$OUT/$p.txt"
  {
    echo "== $p: $(cat "$OUT/$p"/rank-*.json | grep -o '"op":"offload"' | wc -l) offloads," \
      "$(cat "$OUT/$p"/rank-*.json | grep -o '"op":"recompute"' | wc -l) recomputes"
    grep -E '^step [0-9]+:' "$OUT/$p.txt" | tail -1
    grep -E '^peak memory per rank|^GPU memory pool peak|copies \(last step\)|^makespan|^calibrated' "$OUT/$p.txt" || true
  } >>"$OUT/summary.txt"
done
cat "$OUT/summary.txt"
