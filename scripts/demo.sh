#!/usr/bin/env bash
# The main job: set up, build the embedded engines if needed, run SSD on SmolLM2 with metrics,
# then plain decoding of the same GGUF file on llama.cpp's kernels (the ggml engine, both cores)
# for comparison: on a small CPU the second is the faster (README, "Measured").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
prompts=(--prompt "def fibonacci(n):" --prompt "Write a haiku about the sea.")
.venv/bin/trtssd --log-level WARNING generate --mode ssd --max-tokens 96 "${prompts[@]}" "$@"
.venv/bin/trtssd --log-level WARNING build --backend ggml >/dev/null
echo "# the same file, plain decoding on the ggml engine:"
exec .venv/bin/trtssd --log-level WARNING generate --engine engines/smollm2-135m-ggml --mode ar \
  --max-tokens 96 "${prompts[@]}" "$@"
