#!/usr/bin/env bash
# The whole test suite: unit, property, conformance, CLI and end-to-end tests of every crate.
# Needs only a Rust toolchain (rustup); no GPU, no CUDA. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")"
cargo test --workspace --locked
cargo build -p pipec-runtime --features cuda --locked && cargo clippy -p pipec-runtime --features cuda --all-targets --locked -- -D warnings
