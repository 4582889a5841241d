#!/usr/bin/env bash
# trtssd serve (default mode, --mode ar) against llama-server with JSON-schema answers (results.json).
# Run on a quiet machine: both servers need both cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
bash scripts/setup.sh
exec .venv/bin/python docs/bench/structured-outputs-vs-llama-server/measure.py "$@"
