#!/usr/bin/env bash
# Set up, then run the whole test suite (slow real-model tests included), then lint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
