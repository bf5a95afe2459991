#!/usr/bin/env bash
# The whole test suite: unit, property, conformance, CLI and end-to-end tests of every crate.
# Needs only a Rust toolchain (rustup); no GPU, no CUDA. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")"
cargo test --workspace --locked
# The CUDA backend builds, tests and lints clean without CUDA: its libraries load at run time.
# NVRTC is a compiler library that needs no GPU: when PyPI is reachable, its wheel is fetched
# (once, into target/) so the kernel source is compiled for sm_90 by the real NVRTC.
nvrtc_env=()
nvrtc_dir=target/nvrtc-12.9.86
if [ ! -f "$nvrtc_dir/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  rm -rf "$nvrtc_dir.tmp" && mkdir -p "$nvrtc_dir.tmp"
  if python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$nvrtc_dir.tmp" \
      nvidia-cuda-nvrtc-cu12==12.9.86 &&
     python3 -m zipfile -e "$nvrtc_dir.tmp"/nvidia_cuda_nvrtc_cu12-*.whl "$nvrtc_dir.tmp/x"; then
    rm -rf "$nvrtc_dir" && mv "$nvrtc_dir.tmp/x" "$nvrtc_dir"
  else
    echo "test.sh: NVRTC wheel not available from PyPI; the NVRTC tests will say 'skipped'" >&2
  fi
  rm -rf "$nvrtc_dir.tmp"
fi
if [ -f "$nvrtc_dir/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  nvrtc_env=(env "LD_LIBRARY_PATH=$PWD/$nvrtc_dir/nvidia/cuda_nvrtc/lib" PIPEC_REQUIRE_NVRTC=1)
fi
"${nvrtc_env[@]}" cargo test -p pipec-runtime --features cuda --locked
cargo clippy -p pipec-runtime --features cuda --all-targets --locked -- -D warnings
# Python (the Megatron recorder, tests/golden/megatron/record.py): linted and formatted with ruff,
# installed once into target/ from PyPI.
ruff=target/ruff-0.17.6/bin/ruff
if [ ! -x "$ruff" ]; then
  rm -rf target/ruff-0.17.6
  python3 -m venv target/ruff-0.17.6 && target/ruff-0.17.6/bin/pip install --quiet ruff==0.17.6 ||
    { rm -rf target/ruff-0.17.6; echo "test.sh: ruff not available from PyPI; Python lint skipped" >&2; }
fi
if [ -x "$ruff" ]; then
  "$ruff" check . && "$ruff" format --check .
fi
# The fuzz targets (outside the workspace, run with `cargo +nightly fuzz`) still compile.
cargo check --manifest-path fuzz/Cargo.toml --bins --locked
