#!/usr/bin/env bash
# The main job: set up, build the embedded engine if needed, and run SSD on SmolLM2 with metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/trtssd --log-level WARNING generate --mode ssd --max-tokens 96 \
  --prompt "def fibonacci(n):" --prompt "Write a haiku about the sea." "$@"
