#!/usr/bin/env bash
# Grammar engines' per-token costs on Qwen2.5's vocabulary (results.json).
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/python -m pip install -q "llguidance==1.9.1"
exec .venv/bin/python docs/bench/grammar-engine-mask-cost/measure.py
