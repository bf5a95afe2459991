#!/usr/bin/env bash
# The whole test suite: unit, property, conformance, CLI and end-to-end tests of every crate.
# Needs only a Rust toolchain (rustup); no GPU, no CUDA. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")"
cargo test --workspace --locked
# The CUDA backend builds (and lints clean) without CUDA: its libraries load at run time.
cargo build -p pipec-runtime --features cuda --locked
cargo clippy -p pipec-runtime --features cuda --all-targets --locked -- -D warnings
# The fuzz targets (outside the workspace, run with `cargo +nightly fuzz`) still compile.
cargo check --manifest-path fuzz/Cargo.toml --bins --locked
