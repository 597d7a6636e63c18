#!/usr/bin/env bash
# Set up, run the tests, then lint.
#   scripts/test.sh            the whole suite (slow real-model tests included); what CI runs
#   scripts/test.sh --unit     only the unit tier (-m unit: tests/unit/ and tests/kernels/, under a minute)
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [[ "${1:-}" == "--unit" ]]; then
    shift
    tier=(-m unit)
fi
bash scripts/setup.sh
.venv/bin/python -m pytest -q "${tier[@]}" "$@"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
