#!/usr/bin/env bash
# Set up, then run the main job: a streamed generation from the packaged model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m engine_service.model.generate "What is the capital of France?"
