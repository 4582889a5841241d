#!/usr/bin/env bash
# Load control on a fresh LLM per prompt set: trtssd ar and auto (ssd under load control) on both
# ggml engines, batch 1, greedy, the prompt sets and lengths of ggml-vs-llamacpp-batch1 (where
# auto's first request waited on a draft prefilling beside it). Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/auto-first-request
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
common=(--datasets humaneval,chat,math --batch 1 --temperature 0 --no-calibrate --no-plots --systems ar,auto)
.venv/bin/trtssd bench "${common[@]}" --engine engines/smollm2-135m-ggml --prompts 4 --max-tokens 96 --k 7 --out "$here/default-engine"
.venv/bin/trtssd bench "${common[@]}" --engine engines/qwen2.5-coder-1.5b-ggml --prompts 2 --max-tokens 64 --k 3 --out "$here/qwen2.5-coder-1.5b"
