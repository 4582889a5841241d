#!/usr/bin/env bash
# ar, sd and ssd on the ggml engines, batch 1, 4 prompts, greedy, one thread per rank; tok/s
# include prefill; the script checks sd/ssd output against ar's. Writes output.txt beside itself.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/bench/ggml-backend-batch1/output.txt
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
{ echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# default engine (SmolLM2-135M Q4_1 self-draft), 4 x 64 tokens, K = 7"
  .venv/bin/python docs/bench/ggml-backend-batch1/modes.py engines/smollm2-135m-ggml ar,sd,ssd 64 7
  echo "# Qwen2.5-Coder 1.5B Q4_K_M / 0.5B, 4 x 32 tokens, K = 3"
  .venv/bin/python docs/bench/ggml-backend-batch1/modes.py engines/qwen2.5-coder-1.5b-ggml ar,sd,ssd 32 3
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"; } 2>/dev/null | tee "$out"
