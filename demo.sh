#!/usr/bin/env bash
# The main job: build pipec, compile Megatron's interleaved 1F1B for a 4-rank, 2-chunk pipeline
# over 8 microbatches (verified on the way), and show its timeline.
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --locked -q -p pipec-cli
pipec=target/release/pipec
$pipec compile --schedule interleaved-1f1b --pp 4 --vpp 2 --microbatches 8 \
    --layout "Et|tt|tt|tt|tt|tt|tt|tL" -o out/interleaved
$pipec show out/interleaved
