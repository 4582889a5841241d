#!/usr/bin/env bash
# `trtssd bench` with its default options (forward timing included) on the Qwen pair's ggml engine:
# ar, sd and ssd, batch 1, greedy, 4 prompts per set x 64 tokens (results.md; results.json.gz).
set -euo pipefail
cd "$(dirname "$0")/../../.."
bash scripts/setup.sh
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
out=$(mktemp -d)
.venv/bin/trtssd bench --engine engines/qwen2.5-coder-1.5b-ggml --systems ar,sd,ssd --out "$out"
cp "$out/results.md" docs/bench/bench-defaults-qwen-ggml/
gzip -9c "$out/results.json" >docs/bench/bench-defaults-qwen-ggml/results.json.gz
