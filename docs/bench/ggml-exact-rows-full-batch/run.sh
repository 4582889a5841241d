#!/usr/bin/env bash
# Exact rows at full batch width on llama.cpp's CPU kernels: each kernel setting on the default
# engine's and the Qwen pair's target files (run.py says what is measured). Quiet machine only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/bench/ggml-exact-rows-full-batch
.venv/bin/trtssd build --backend ggml >/dev/null
.venv/bin/trtssd build qwen2.5-coder-1.5b --backend ggml >/dev/null
{
  for gguf in engines/smollm2-135m-ggml/target/model.gguf engines/qwen2.5-coder-1.5b-ggml/target/model.gguf; do
    .venv/bin/python $here/run.py "$gguf"
    GGML_CPU_TILED_MM=0 .venv/bin/python $here/run.py "$gguf"
    GGML_CPU_TILED_MM_FORCE=1 .venv/bin/python $here/run.py "$gguf"
  done
} 2>/dev/null | tee $here/results.txt
