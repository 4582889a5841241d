#!/usr/bin/env bash
# trtssd on its ggml engines next to llama.cpp's llama-server, batch 4 (four requests decoded
# together; llama-server with four slots), HumanEval + chat + math, tok/s including prefill.
#  default-engine/: greedy and temperature 0.8; trtssd ar (both cores, exact rows), ssd (one core
#    per rank), auto (ssd under load control); llama.cpp on 2 threads.
#  qwen2.5-coder-1.5b/: greedy; the same systems and llama.cpp's sd with the 0.5B draft.
# Writes one folder per engine beside itself; run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/ggml-vs-llamacpp-batch4
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
common=(--datasets humaneval,chat,math --batch 4 --prompts 4 --no-calibrate --no-plots --llamacpp-threads 2)
bench() { .venv/bin/trtssd bench "${common[@]}" "$@"; }
bench --engine engines/smollm2-135m-ggml --max-tokens 96 --k 7 --temperature 0,0.8 \
  --systems ar,ssd,auto,llama.cpp --out "$here/default-engine"
bench --engine engines/qwen2.5-coder-1.5b-ggml --max-tokens 64 --k 3 --temperature 0 \
  --systems ar,ssd,auto,llama.cpp,llama.cpp-sd --out "$here/qwen2.5-coder-1.5b"
