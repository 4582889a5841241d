#!/usr/bin/env bash
# The test command: sets up .venv, then runs the whole suite on CPU (GPU tests skip themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
