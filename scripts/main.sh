#!/usr/bin/env bash
# Set up, then run the main job: forkline-engine + forkline-prefix on free loopback ports, two rounds of
# a prompt through the prefix service's gateway (the second reuses all but the final prompt token),
# then both services are stopped. Extra arguments go to `python -m clients.demo` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m clients.demo "$@"
