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
  elif [ "${CI:-}" = true ]; then
    echo "test.sh: CI=true and the NVRTC wheel (nvidia-cuda-nvrtc-cu12==12.9.86) could not be fetched from PyPI" >&2
    exit 1
  else
    echo "test.sh: NVRTC wheel not available from PyPI; the NVRTC tests will say 'skipped'" >&2
  fi
  rm -rf "$nvrtc_dir.tmp"
fi
if [ -f "$nvrtc_dir/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  nvrtc_env=(env "LD_LIBRARY_PATH=$PWD/$nvrtc_dir/nvidia/cuda_nvrtc/lib" PIPEC_REQUIRE_NVRTC=1)
fi
"${nvrtc_env[@]}" cargo test -p pipec-cuda -p pipec-cli --features pipec-cli/cuda --locked
# Lints and formatting of every crate, with and without the CUDA feature.
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p pipec-tests -p pipec-cuda -p pipec-cli --features pipec-tests/cuda,pipec-cli/cuda --all-targets --locked -- -D warnings
# Python (the Megatron recorder, tests/golden/megatron/record.py): linted and formatted with ruff,
# installed once into target/ from PyPI.
ruff=target/ruff-0.17.6/bin/ruff
if [ ! -x "$ruff" ]; then
  rm -rf target/ruff-0.17.6
  python3 -m venv target/ruff-0.17.6 && target/ruff-0.17.6/bin/pip install --quiet ruff==0.17.6 ||
    { rm -rf target/ruff-0.17.6; echo "test.sh: ruff not available from PyPI; Python lint skipped" >&2; }
fi
if [ ! -x "$ruff" ] && [ "${CI:-}" = true ]; then
  echo "test.sh: CI=true and ruff==0.17.6 could not be installed from PyPI" >&2
  exit 1
fi
if [ -x "$ruff" ]; then
  "$ruff" check . && "$ruff" format --check .
fi
# The fuzz targets (outside the workspace, run with `cargo +nightly fuzz`) still compile.
cargo check --manifest-path fuzz/Cargo.toml --bins --locked
# Python: the pipec package (python/, pyo3 + maturin) and its tests: the API and its errors,
# training on torch's own pipeline runtime (multi-process, gloo on loopback, bounded in time),
# the docs' example scripts, the torchtitan recipe, and training inside megatron-core (CPU, gloo).
# The virtual environment is created once under target/ with torch from PyPI (the full wheel, a
# few minutes the first time); a warm run only rebuilds the extension (incrementally) and runs
# pytest.
py_venv=target/py312-venv
# megatron-core (a CPython 3.12 wheel; it needs only torch, numpy and packaging) for the
# Megatron-LM tests (python/tests/test_megatron.py).
# DeepSpeed 0.19.8 for python/tests/test_deepspeed.py: an sdist, built without its ops
# (DS_BUILD_OPS=0; no compiler needed); it requires einops, hjson, msgpack, ninja, numpy,
# packaging, psutil, py-cpuinfo, pydantic>=2, torch and tqdm (its PKG-INFO), which pip resolves.
py_deps=(torch==2.15.0 numpy==2.5.5 maturin==1.16.0 pytest==9.2.0 pytest-timeout==2.4.0
  megatron-core==0.19.2 packaging==26.3 deepspeed==0.19.8)
py_stamp="$py_venv/.pipec-deps-$(echo "${py_deps[*]}" | cksum | cut -d' ' -f1)"
pypi_unreachable() {
  ! python3 -c 'import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20)' 2>/dev/null
}
py_ready=0
if [ -f "$py_stamp" ]; then
  py_ready=1
else
  # CPython 3.12 (pyenv's when installed; a pyenv shim of another version fails the probe), or
  # any python3 >= 3.10.
  py=
  for c in "${PIPEC_PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3 python3; do
    if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
      py=$c && break
    fi
  done
  [ -n "$py" ] || { echo "test.sh: no Python >= 3.10 found for the Python tests" >&2; exit 1; }
  rm -rf "$py_venv"
  if "$py" -m venv "$py_venv" && DS_BUILD_OPS=0 "$py_venv/bin/pip" install --quiet "${py_deps[@]}"; then
    touch "$py_stamp" && py_ready=1
  elif [ "${CI:-}" != true ] && pypi_unreachable; then
    rm -rf "$py_venv"
    echo "test.sh: PyPI is not reachable; the Python package tests (python/tests) are SKIPPED" >&2
  else
    echo "test.sh: installing the Python test environment failed (${py_deps[*]})" >&2 && exit 1
  fi
fi
if [ "$py_ready" = 1 ]; then
  # torchtitan's schedule builder for the torchtitan recipe test, without its data and logging
  # dependencies (the builder needs none of them); the tests skip it when absent.
  tt_dir=target/py312-torchtitan
  tt_deps=(torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0)
  if [ ! -f "$tt_dir/.complete" ]; then
    rm -rf "$tt_dir"
    if "$py_venv/bin/pip" install --quiet --no-deps --target "$tt_dir" "${tt_deps[@]}"; then
      touch "$tt_dir/.complete"
    else
      rm -rf "$tt_dir"
      [ "${CI:-}" = true ] && { echo "test.sh: CI=true and torchtitan==0.3.0 could not be installed" >&2; exit 1; }
      echo "test.sh: torchtitan not available from PyPI; its recipe test will say 'skipped'" >&2
    fi
  fi
  # NeMo AutoModel's schedule builder for its recipe test, likewise without its dependencies.
  # Under CI=true its absence fails the run (the test refuses to be skipped there).
  am_dir=target/py312-automodel
  if [ ! -f "$am_dir/.complete" ]; then
    rm -rf "$am_dir"
    if "$py_venv/bin/pip" install --quiet --no-deps --target "$am_dir" nemo_automodel==0.7.0; then
      touch "$am_dir/.complete"
    else
      rm -rf "$am_dir"
      [ "${CI:-}" = true ] && { echo "test.sh: CI=true and nemo_automodel==0.7.0 could not be installed" >&2; exit 1; }
      echo "test.sh: nemo_automodel not available from PyPI; its recipe test will say 'skipped'" >&2
    fi
  fi
  "$py_venv/bin/pip" install --quiet --no-deps --force-reinstall --no-build-isolation ./python
  PIPEC_TORCHTITAN_PATH="$PWD/$tt_dir" PIPEC_AUTOMODEL_PATH="$PWD/$am_dir" \
    "$py_venv/bin/pytest" -q python/tests -p no:cacheprovider
fi
