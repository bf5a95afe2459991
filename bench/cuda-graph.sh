#!/usr/bin/env bash
# The captured step of the CUDA backend (issue 39, `pipec-run --cuda-graph`), in one go on a
# GPU machine:
#   1. the GPU test of tests/integration/cuda_graph.rs (`--cuda-graph --steps 4 --check` in f32
#      and bf16 for 1F1B, interleaved with batches in flight, ZB-V, DualPipe-V and a
#      checkpointed program);
#   2. eager against graph step time: 1F1B pp=4 M=16 and interleaved pp=4 vpp=2 M=16 on one GPU,
#      at a small size (hidden 512, seq 512: kernels short, launches matter) and at docs/cuda.md's
#      benchmark size (bf16, hidden 4096, seq 4096), each run eagerly and with --cuda-graph for
#      6 steps; summary.txt has the last eager step beside the median replayed one.
#
#   bench/cuda-graph.sh                       # builds with cargo, runs everything
#   BIN=/path/to/release bench/cuda-graph.sh  # prebuilt pipec and pipec-run (no toolchain);
#       TEST_BIN=/path/to/integration-<hash> also runs the GPU test with them
#
# Output under OUT (default /tmp/pipec-graph): NAME.eager.txt, NAME.graph.txt (pipec-run's
# reports), summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pipec-graph}
mkdir -p "$OUT"

if [ -z "${BIN:-}" ]; then
  cargo build --release -p pipec-cli --features cuda
  BIN=target/release
fi
"$BIN/pipec-run" --cuda-info
if [ -n "${TEST_BIN:-}" ]; then
  PIPEC_CUDA_RUN_BIN=$PWD/$BIN/pipec-run "$TEST_BIN" cuda_graph --ignored --test-threads 1
elif command -v cargo >/dev/null; then
  cargo test -p pipec-tests --features cuda --test integration cuda_graph -- --ignored --test-threads 1
fi

"$BIN/pipec" compile --schedule 1f1b --pp 4 --microbatches 16 -o "$OUT/1f1b"
"$BIN/pipec" compile --schedule interleaved-1f1b --pp 4 --vpp 2 --microbatches 16 -o "$OUT/interleaved"
small=(--dtype bf16 --hidden 512 --ffn 2048 --vocab 8192 --seq 512)
large=(--dtype bf16 --hidden 4096 --ffn 16384 --vocab 32768 --seq 4096)

: >"$OUT/summary.txt"
for p in 1f1b interleaved; do
  for size in small large; do
    declare -n args=$size
    name=$p.$size
    "$BIN/pipec-run" "$OUT/$p" --backend cuda "${args[@]}" --steps 6 | tee "$OUT/$name.eager.txt"
    "$BIN/pipec-run" "$OUT/$p" --backend cuda "${args[@]}" --steps 6 --cuda-graph |
      tee "$OUT/$name.graph.txt"
    {
      echo "== $name"
      echo "eager: $(grep -E '^step 6:' "$OUT/$name.eager.txt")"
      grep -E '^cuda graph:' "$OUT/$name.graph.txt"
      grep -E '^GPU memory pool peak' "$OUT/$name.eager.txt" "$OUT/$name.graph.txt" || true
    } >>"$OUT/summary.txt"
  done
done
cat "$OUT/summary.txt"
